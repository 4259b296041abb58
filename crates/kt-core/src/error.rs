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

impl Error {
    /// The same error with `what: ` in front of its message (the variant, i.e. the Python
    /// exception class, is kept).
    pub fn context(self, what: &str) -> Error {
        let prefix = |m: String| format!("{what}: {m}");
        match self {
            Error::Invalid(m) => Error::Invalid(prefix(m)),
            Error::Dtype(m) => Error::Dtype(prefix(m)),
            Error::NotFound(m) => Error::NotFound(prefix(m)),
            Error::Format(m) => Error::Format(prefix(m)),
            Error::Unsupported(m) => Error::Unsupported(prefix(m)),
            Error::Runtime(m) => Error::Runtime(prefix(m)),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::NotFound(e.to_string())
        } else {
            Error::Runtime(format!("I/O error: {e}"))
        }
    }
}

/// An I/O error on `path` as an [`Error`] that names the path and what was being done
/// (`action`, e.g. "read"): NotFound stays FileNotFoundError, the rest are RuntimeErrors.
pub fn io_error_at(path: &std::path::Path, action: &str, e: std::io::Error) -> Error {
    let path = path.display();
    match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(format!("{path} does not exist")),
        _ => Error::Runtime(format!("cannot {action} {path}: {e}")),
    }
}

/// `path`'s metadata (without opening it); `what` names it in errors, e.g. "GGUF path".
pub fn metadata_of(path: &std::path::Path, what: &str) -> Result<std::fs::Metadata> {
    std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            Error::NotFound(format!("{what} {} does not exist", path.display()))
        }
        _ => io_error_at(path, "inspect", e),
    })
}

/// Open `path` for reading if it is a regular file (`what` names it in errors, e.g. "GGUF
/// file"). The type is checked first, from the path: opening a FIFO would block until a
/// writer appears, and a directory or device only fails later with an unhelpful error.
pub fn open_regular_file(path: &std::path::Path, what: &str) -> Result<std::fs::File> {
    let meta = metadata_of(path, what)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(Error::Invalid(format!(
            "{what} {} is {kind}",
            path.display()
        )));
    }
    std::fs::File::open(path).map_err(|e| io_error_at(path, "open", e))
}

/// The first error of many parallel tasks: each task records its result, the caller gets
/// the first failure (or Ok) once the tasks are done.
#[derive(Default)]
pub struct FirstError(std::sync::Mutex<Option<Error>>);

impl FirstError {
    /// No error yet.
    pub fn new() -> FirstError {
        FirstError::default()
    }

    /// Keep `result`'s error unless an earlier one is kept.
    pub fn record(&self, result: Result<()>) {
        if let Err(e) = result {
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    }

    /// Whether an error was recorded (lets later tasks stop early).
    pub fn is_set(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// The first recorded error, or Ok.
    pub fn into_result(self) -> Result<()> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
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
