//! The only place where kt-core errors become Python exceptions.
use kt_core::Error;
use pyo3::exceptions::{
    PyFileNotFoundError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::PyErr;

/// Map a kt-core error to its Python exception class.
pub fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) | Error::Format(m) => PyValueError::new_err(m),
        Error::Dtype(m) => PyTypeError::new_err(m),
        Error::NotFound(m) => PyFileNotFoundError::new_err(m),
        Error::Unsupported(m) => PyNotImplementedError::new_err(m),
        Error::Runtime(m) => PyRuntimeError::new_err(m),
    }
}

/// `Result` conversion helper.
pub trait IntoPy<T> {
    /// Convert the error side.
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for kt_core::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
