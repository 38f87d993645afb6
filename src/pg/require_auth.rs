//! libpq's `require_auth`: which authentication methods the server may ask for, so that a man in the middle
//! (or a misconfigured `pg_hba.conf`) cannot downgrade a SCRAM login to a password sent in the clear or as
//! MD5. Pure: the policy, and a scanner that finds the server's first authentication request in the bytes
//! it sends. Enforcing it is the connections': the replication connection's authentication state machine,
//! and the SQL connections' TLS stream (`guarded_tls`), since tokio-postgres has no such setting.

/// An authentication method a server may ask for, in `require_auth`'s words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// A password sent in the clear (`AuthenticationCleartextPassword`).
    Password,
    /// An MD5 hash of the password (`AuthenticationMD5Password`).
    Md5,
    /// GSSAPI (Kerberos).
    Gss,
    /// SSPI (Windows).
    Sspi,
    /// SCRAM-SHA-256 (SASL).
    ScramSha256,
    /// No authentication exchange at all (the server says `AuthenticationOk` first: trust, peer, cert).
    None,
}

const METHODS: [(Method, &str); 6] = [
    (Method::Password, "password"),
    (Method::Md5, "md5"),
    (Method::Gss, "gss"),
    (Method::Sspi, "sspi"),
    (Method::ScramSha256, "scram-sha-256"),
    (Method::None, "none"),
];

impl Method {
    /// The method as `require_auth` names it.
    pub fn as_str(self) -> &'static str {
        METHODS
            .iter()
            .find(|(method, _)| *method == self)
            .map_or("?", |(_, name)| name)
    }

    /// What the server did, for an error message.
    fn described(self) -> &'static str {
        match self {
            Method::Password => "asked for the password in the clear",
            Method::Md5 => "asked for an MD5 hash of the password",
            Method::Gss => "asked for GSSAPI authentication",
            Method::Sspi => "asked for SSPI authentication",
            Method::ScramSha256 => "asked for SCRAM-SHA-256 authentication",
            Method::None => "let the connection in without authentication",
        }
    }

    /// The method of an `Authentication` message's request code, when it is the server's first one.
    pub fn of_first_request(code: u32) -> Option<Method> {
        Some(match code {
            0 => Method::None,
            3 => Method::Password,
            5 => Method::Md5,
            7 | 8 => Method::Gss,
            9 => Method::Sspi,
            10 => Method::ScramSha256,
            _ => return None,
        })
    }
}

/// The URL's `require_auth` (libpq 16): the methods the server may use, or those it may not (`!md5`).
/// The default allows every method.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequireAuth {
    /// As written in the URL, for messages; `None`: not given.
    written: Option<String>,
    /// The methods named.
    named: Vec<Method>,
    /// Whether the methods named are the ones refused (`!method`).
    negated: bool,
}

/// The server used a method `require_auth` does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the server {} ({}), which the URL's require_auth={} does not allow: a man in the middle, or a pg_hba.conf line with another method", .method.described(), .method.as_str(), .written)]
pub struct Refused {
    /// What the server asked for.
    pub method: Method,
    /// The URL's `require_auth`.
    pub written: String,
}

impl Refused {
    /// What to do about it.
    pub const FIX: &'static str = "make pg_hba.conf use an allowed method for this user (scram-sha-256, with the password stored as SCRAM), check that the URL reaches the server itself (sslmode=verify-full), or change require_auth";
}

impl RequireAuth {
    /// Parses libpq's syntax: a comma-separated list of `password`, `md5`, `gss`, `sspi`, `scram-sha-256`,
    /// `none`, all of them plain (the allowed ones) or all with `!` (the refused ones).
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut policy = RequireAuth {
            written: Some(value.to_string()),
            ..RequireAuth::default()
        };
        for (index, word) in value.split(',').map(str::trim).enumerate() {
            let (negated, name) = match word.strip_prefix('!') {
                Some(name) => (true, name),
                None => (false, word),
            };
            if index > 0 && negated != policy.negated {
                return Err(format!(
                    "require_auth={value} mixes allowed and refused (!) methods; use one kind, e.g. require_auth=scram-sha-256 or require_auth=!password,!md5"
                ));
            }
            policy.negated = negated;
            let method = METHODS
                .iter()
                .find(|(_, known)| *known == name)
                .map(|(method, _)| *method)
                .ok_or_else(|| {
                    format!(
                        "require_auth names an unknown method \"{name}\"; use password, md5, gss, sspi, scram-sha-256 or none (or !method)"
                    )
                })?;
            if policy.named.contains(&method) {
                return Err(format!(
                    "require_auth names \"{name}\" twice; name each method once"
                ));
            }
            policy.named.push(method);
        }
        if policy.negated && policy.named.len() == METHODS.len() {
            return Err(format!(
                "require_auth={value} refuses every method, so no connection could succeed; remove some"
            ));
        }
        Ok(policy)
    }

    /// Whether the URL gave `require_auth`.
    pub fn is_given(&self) -> bool {
        self.written.is_some()
    }

    /// Whether a server may use `method`.
    pub fn check(&self, method: Method) -> Result<(), Refused> {
        let listed = self.named.contains(&method);
        if self.written.is_none() || listed != self.negated {
            Ok(())
        } else {
            Err(Refused {
                method,
                written: self.written.clone().unwrap_or_default(),
            })
        }
    }
}

/// Reads what the server sends at start-up until its first `Authentication` message, byte by byte as it
/// arrives (messages before it, such as `NegotiateProtocolVersion`, are skipped without being held), and
/// says which method it asks for. Only the 5-byte header and the 4-byte request code are ever kept.
#[derive(Debug, Default)]
pub struct FirstRequestScanner {
    /// Header bytes of the current message (type and length) and, for `R`, its request code.
    head: Vec<u8>,
    /// Bytes of the current (skipped) message still to come.
    skip: u64,
    /// Set once the first request is seen: everything after passes unread.
    done: bool,
}

/// What the scanner learned from some bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Scanned {
    /// The first request has not arrived in full yet.
    Pending,
    /// The server's first request is this one (`None`: a code that names no method `require_auth`
    /// knows; the connection's own code refuses it).
    FirstRequest(Option<Method>),
    /// The first request was seen before: nothing to check.
    Past,
}

impl FirstRequestScanner {
    /// Feeds the next bytes the server sent.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Scanned {
        while !self.done && !bytes.is_empty() {
            if self.skip > 0 {
                let taken = usize::try_from(self.skip).map_or(bytes.len(), |s| s.min(bytes.len()));
                self.skip -= taken as u64;
                bytes = &bytes[taken..];
                continue;
            }
            let wanted = if self.head.first() == Some(&b'R') {
                9
            } else {
                5
            };
            let taken = (wanted - self.head.len()).min(bytes.len());
            self.head.extend_from_slice(&bytes[..taken]);
            bytes = &bytes[taken..];
            if self.head.len() < wanted {
                continue;
            }
            let length =
                u32::from_be_bytes([self.head[1], self.head[2], self.head[3], self.head[4]]);
            if self.head[0] == b'R' && self.head.len() == 9 {
                self.done = true;
                let code =
                    u32::from_be_bytes([self.head[5], self.head[6], self.head[7], self.head[8]]);
                return Scanned::FirstRequest(Method::of_first_request(code));
            }
            if self.head[0] != b'R' {
                self.skip = u64::from(length.saturating_sub(4));
                self.head.clear();
            }
        }
        if self.done {
            Scanned::Past
        } else {
            Scanned::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libpq_syntax_and_refuses_what_libpq_refuses() {
        let scram = RequireAuth::parse("scram-sha-256").unwrap();
        assert!(scram.check(Method::ScramSha256).is_ok());
        for method in [Method::Password, Method::Md5, Method::None, Method::Gss] {
            let refused = scram.check(method).unwrap_err().to_string();
            assert!(
                refused.contains("require_auth=scram-sha-256") && refused.contains(method.as_str()),
                "{refused}"
            );
        }
        let not_plain = RequireAuth::parse("!password,!md5").unwrap();
        assert!(not_plain.check(Method::ScramSha256).is_ok());
        assert!(not_plain.check(Method::None).is_ok());
        assert!(not_plain.check(Method::Md5).is_err());
        let either = RequireAuth::parse("scram-sha-256,none").unwrap();
        assert!(either.check(Method::None).is_ok());
        assert!(either.check(Method::Password).is_err());
        let default = RequireAuth::default();
        assert!(!default.is_given());
        assert!(default.check(Method::Password).is_ok());
        for bad in [
            "scram",
            "md5,!password",
            "md5,md5",
            "",
            "!password,!md5,!gss,!sspi,!scram-sha-256,!none",
        ] {
            assert!(RequireAuth::parse(bad).is_err(), "{bad}");
        }
    }

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn finds_the_first_request_across_any_split_of_the_bytes() {
        let mut stream = message(b'v', &[0u8; 300]);
        stream.extend(message(b'R', &[0, 0, 0, 3]));
        stream.extend(message(b'Z', b"I"));
        for split in 1..stream.len() {
            let mut scanner = FirstRequestScanner::default();
            let mut found = None;
            for chunk in stream.chunks(split) {
                match scanner.feed(chunk) {
                    Scanned::FirstRequest(method) => found = Some(method),
                    Scanned::Pending => assert!(found.is_none()),
                    Scanned::Past => assert!(found.is_some()),
                }
            }
            assert_eq!(found, Some(Some(Method::Password)), "split {split}");
        }
    }

    #[test]
    fn a_huge_message_before_the_request_is_skipped_not_held() {
        let mut scanner = FirstRequestScanner::default();
        let mut header = vec![b'E'];
        header.extend_from_slice(&(1u32 << 30).to_be_bytes());
        assert_eq!(scanner.feed(&header), Scanned::Pending);
        assert_eq!(scanner.feed(&[0u8; 4096]), Scanned::Pending);
        assert!(scanner.head.capacity() < 64);
    }
}
