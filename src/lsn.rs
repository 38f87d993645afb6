//! `Lsn`: a PostgreSQL WAL position (`XLogRecPtr`), parsed from and formatted as `"16/B374D848"`.
//! Owns only the value type; it knows nothing about which positions may be confirmed.

use std::fmt;
use std::str::FromStr;

/// A WAL location. Ordered, so positions compare as the server compares them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The LSN 0/0.
    pub const ZERO: Lsn = Lsn(0);

    /// Bytes from `earlier` to `self`, or 0 when `earlier` is ahead.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// Text that is not an LSN (`X/Y` in hexadecimal); holds the text.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid LSN {0:?}: expected two hexadecimal numbers separated by '/', like 0/16B6C50")]
pub struct ParseLsnError(String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(text.to_string());
        let (high, low) = text.split_once('/').ok_or_else(err)?;
        if high.is_empty() || low.is_empty() || high.len() > 8 || low.len() > 8 {
            return Err(err());
        }
        let high = u32::from_str_radix(high, 16).map_err(|_| err())?;
        let low = u32::from_str_radix(low, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(high) << 32) | u64::from(low)))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text_form() {
        for text in ["0/0", "0/16B6C50", "16/B374D848", "FFFFFFFF/FFFFFFFF"] {
            let lsn: Lsn = text.parse().unwrap();
            assert_eq!(lsn.to_string(), text);
        }
        assert_eq!("1/0".parse::<Lsn>().unwrap(), Lsn(1 << 32));
    }

    #[test]
    fn rejects_malformed_text() {
        for text in ["", "0", "/1", "1/", "x/1", "1/2/3", "123456789/0", "-1/0"] {
            assert!(text.parse::<Lsn>().is_err(), "{text} should not parse");
        }
    }

    #[test]
    fn orders_and_subtracts() {
        assert!(Lsn(5) > Lsn(4));
        assert_eq!(Lsn(10).bytes_since(Lsn(4)), 6);
        assert_eq!(Lsn(4).bytes_since(Lsn(10)), 0);
    }
}
