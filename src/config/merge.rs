//! The `--config` file under flags and environment: read, then merged option by option, by name.

use std::path::Path;

use super::{invalid, ConfigError, Options};

impl Options {
    /// Fills every option not given by flag or environment from the `--config` file.
    pub fn with_file(self) -> Result<Options, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let file = Options::from_file(&path)?;
        self.or(file)
    }

    fn from_file(path: &Path) -> Result<Options, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
            path: path.into(),
            message: e.to_string(),
        })
    }

    /// `self` (flags and environment) over `file`, option by option: a flag left unset (`None`, or a switch
    /// left off) takes the file's value.
    pub(super) fn or(self, file: Options) -> Result<Options, ConfigError> {
        let table = |options: &Options| {
            toml::Table::try_from(options)
                .map_err(|e| invalid(format!("cannot merge the options: {e}")))
        };
        let mut merged = table(&file)?;
        merged.extend(table(&self)?);
        // What a struct serialised reads back as itself; the error would quote a value (maybe a URL with its
        // password), so it is not repeated.
        let mut options: Options = merged.try_into().map_err(|_| {
            invalid("cannot merge the options given by flag or environment with the file")
        })?;
        options.config = self.config;
        Ok(options)
    }
}
