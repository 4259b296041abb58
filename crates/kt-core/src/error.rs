//! The one error type of kt-core. Bindings map each variant to one Python exception class.
use std::fmt;

/// Everything that can go wrong in kt-core. Messages are complete sentences that name the
/// argument, layer, method, shape or ISA involved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A bad argument value or shape (Python: ValueError).
    Invalid(String),
    /// A wrong element type (Python: TypeError).
    Dtype(String),
    /// A file that does not exist (Python: FileNotFoundError).
    NotFound(String),
    /// A malformed, truncated or inconsistent file (Python: ValueError).
    Format(String),
    /// Something valid that this build or CPU cannot do (Python: NotImplementedError).
    Unsupported(String),
    /// Anything else at run time, e.g. an I/O error or a panicked task (Python: RuntimeError).
    Runtime(String),
}

/// Shorthand for results in kt-core.
pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (Error::Invalid(m)
        | Error::Dtype(m)
        | Error::NotFound(m)
        | Error::Format(m)
        | Error::Unsupported(m)
        | Error::Runtime(m)) = self;
        f.write_str(m)
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound(e.to_string())
        } else {
            Error::Runtime(format!("I/O error: {e}"))
        }
    }
}

/// Return early with an [`Error`] variant built from a format string.
#[macro_export]
macro_rules! kt_bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::Error::$kind(format!($($arg)*)))
    };
}

/// Return early with an [`Error`] variant unless the condition holds.
#[macro_export]
macro_rules! kt_ensure {
    ($cond:expr, $kind:ident, $($arg:tt)*) => {
        if !$cond {
            $crate::kt_bail!($kind, $($arg)*);
        }
    };
}
