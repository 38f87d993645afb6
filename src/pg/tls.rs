//! TLS to PostgreSQL with libpq's `sslmode` semantics on both the SQL connections (tokio-postgres) and the
//! replication connection (our wire client). tokio-postgres understands only disable/prefer/require, so the
//! URL is split here: `sslmode` and `sslrootcert` are taken out and turned into an OpenSSL connector, and
//! the rest goes to tokio-postgres. Owns parsing and the connector; not the sockets.

use std::path::{Path, PathBuf};

use openssl::ssl::{SslConnector, SslMethod, SslVerifyMode};
use openssl::x509::store::{X509Store, X509StoreBuilder};
use openssl::x509::X509;
use postgres_openssl::MakeTlsConnector;
use tokio_openssl::SslStream;

use super::require_auth::RequireAuth;

/// libpq's `sslmode` values outboxd supports (`allow` is refused: it is never what anyone wants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, else plaintext; no certificate checks (libpq's default).
    #[default]
    Prefer,
    /// TLS required; the chain is checked only when `sslrootcert` is given.
    Require,
    /// TLS with the server's certificate chained to a trusted CA.
    VerifyCa,
    /// As verify-ca, and the certificate must name the host.
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                "sslmode={other} is not supported; use disable, prefer, require, verify-ca or verify-full"
            ))
            }
        })
    }

    /// The mode as written in a URL (e.g. `verify-full`).
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether a server without TLS is acceptable.
    pub fn allows_plaintext(self) -> bool {
        matches!(self, SslMode::Disable | SslMode::Prefer)
    }
}

/// What the TLS handshake must prove.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    /// The URL's `sslmode` (libpq's default, prefer, without one).
    pub mode: SslMode,
    /// CA certificate(s) the server's certificate must chain to (libpq's `sslrootcert`).
    pub root_cert: Option<PathBuf>,
    /// The authentication methods the server may ask for (libpq's `require_auth`): like `sslmode`, what
    /// the server must prove is taken out of the URL here, since tokio-postgres cannot express it.
    pub require_auth: RequireAuth,
    /// The client certificate (chain) offered to the server (libpq's `sslcert`; its default
    /// `~/.postgresql/postgresql.crt` when that file exists).
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (libpq's `sslkey`; default `~/.postgresql/postgresql.key`).
    pub client_key: Option<PathBuf>,
}

impl TlsSettings {
    /// Certificate checks in force: libpq verifies the chain for verify-ca/verify-full, and for `require`
    /// when a root certificate is given or its default root file exists.
    fn verifies_chain(&self) -> bool {
        match self.mode {
            SslMode::VerifyCa | SslMode::VerifyFull => true,
            SslMode::Require => {
                self.root_cert.is_some() || default_root_cert().is_some_and(|path| path.exists())
            }
            SslMode::Disable | SslMode::Prefer => false,
        }
    }

    /// Whether the server's certificate is checked at all; `false` means TLS protects only against
    /// listening, not against a man in the middle.
    pub fn authenticates_server(&self) -> bool {
        self.verifies_chain()
    }

    /// Builds the OpenSSL connector used by every PostgreSQL connection of this URL. As libpq, it trusts
    /// only the CA certificates of `sslrootcert` (else `~/.postgresql/root.crt`), never the system's store,
    /// unless `sslrootcert=system` asks for that store (with verify-full only, as libpq 16). A missing or
    /// unreadable root certificate is an error naming `sslrootcert`.
    pub fn ssl_connector(&self) -> Result<SslConnector, String> {
        let mut builder = SslConnector::builder(SslMethod::tls_client())
            .map_err(|e| format!("cannot initialise OpenSSL: {e}"))?;
        if self.root_cert.as_deref() == Some(Path::new(SYSTEM_ROOTS)) {
            if self.mode != SslMode::VerifyFull {
                return Err(format!(
                    "sslrootcert=system trusts every CA of the system's store, so it needs sslmode=verify-full (the host name checked), not sslmode={}; fix: use sslmode=verify-full",
                    self.mode.as_str()
                ));
            }
            // SslConnector::builder loaded the system's default verify paths.
            builder.set_verify(SslVerifyMode::PEER);
        } else if self.verifies_chain() {
            let path = self
                .root_cert
                .clone()
                .or_else(default_root_cert)
                .ok_or_else(|| {
                    format!(
                        "sslmode={} needs a CA certificate; add sslrootcert=/path/to/ca.crt to the URL",
                        self.mode.as_str()
                    )
                })?;
            builder.set_cert_store(only_roots_of(&path, self.mode)?);
            builder.set_verify(SslVerifyMode::PEER);
        } else {
            builder.set_verify(SslVerifyMode::NONE);
        }
        if let Some((cert, key)) = self.client_certificate()? {
            builder.set_certificate_chain_file(&cert).map_err(|e| {
                format!("cannot read the client certificate {} ({e}); fix: point sslcert= in the URL at a readable PEM file", cert.display())
            })?;
            check_key_permissions(&key)?;
            builder
                .set_private_key_file(&key, openssl::ssl::SslFiletype::PEM)
                .map_err(|e| {
                    format!("cannot read the client key {} ({e}); fix: point sslkey= in the URL at a readable PEM key without a passphrase", key.display())
                })?;
            builder.check_private_key().map_err(|_| {
                format!(
                    "the client key {} does not belong to the certificate {}; fix: give the sslkey= that matches sslcert=",
                    key.display(),
                    cert.display()
                )
            })?;
        }
        Ok(builder.build())
    }

    /// The client certificate and key to offer, as libpq finds them: `sslcert`/`sslkey`, else the default
    /// files when the certificate exists; `None` without a certificate, or with `sslmode=disable`.
    fn client_certificate(&self) -> Result<Option<(PathBuf, PathBuf)>, String> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let cert = match &self.client_cert {
            Some(cert) => cert.clone(),
            None => match default_client_file("postgresql.crt").filter(|path| path.exists()) {
                Some(cert) => cert,
                None => return Ok(None),
            },
        };
        let key = self
            .client_key
            .clone()
            .or_else(|| default_client_file("postgresql.key"))
            .ok_or_else(|| {
                format!(
                    "the client certificate {} has no key; fix: add sslkey=/path/to/client.key to the URL",
                    cert.display()
                )
            })?;
        Ok(Some((cert, key)))
    }

    /// The SQL connections' connector (tokio-postgres), with the host-name check of this mode.
    pub fn connector(&self, ssl: SslConnector) -> MakeTlsConnector {
        let mut connector = MakeTlsConnector::new(ssl);
        let check_host_name = self.mode == SslMode::VerifyFull;
        connector.set_callback(move |config, _host| {
            config.set_verify_hostname(check_host_name);
            Ok(())
        });
        connector
    }

    /// TLS over `stream` for the replication connection, with the same checks as the SQL connections.
    /// Returns the stream and its `tls-server-end-point` channel-binding data (RFC 5929), for
    /// SCRAM-SHA-256-PLUS.
    pub async fn handshake<S>(
        &self,
        ssl: &SslConnector,
        host: &str,
        stream: S,
    ) -> Result<(SslStream<S>, Option<Vec<u8>>), String>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let mut config = ssl.configure().map_err(|e| e.to_string())?;
        config.set_verify_hostname(self.mode == SslMode::VerifyFull);
        let ssl = config.into_ssl(host).map_err(|e| e.to_string())?;
        let mut stream = SslStream::new(ssl, stream).map_err(|e| e.to_string())?;
        std::pin::Pin::new(&mut stream)
            .connect()
            .await
            .map_err(|e| format!("error performing TLS handshake: {e}"))?;
        let binding = tls_server_end_point(stream.ssl());
        Ok((stream, binding))
    }
}

/// `sslrootcert=system`: the system's CA store (libpq 16).
const SYSTEM_ROOTS: &str = "system";

/// libpq's default root certificate file, `~/.postgresql/root.crt`.
fn default_root_cert() -> Option<PathBuf> {
    // An empty HOME is no home: never a relative path that makes the working directory's file a trust anchor.
    std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(|home| PathBuf::from(home).join(".postgresql/root.crt"))
}

/// libpq's default client certificate or key file in `~/.postgresql`.
fn default_client_file(name: &str) -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(|home| PathBuf::from(home).join(".postgresql").join(name))
}

/// As libpq: a private key others may read is refused (0600 or stricter for a key of outboxd's own user,
/// 0640 or stricter for one root owns, so a group can share it).
#[cfg(unix)]
fn check_key_permissions(key: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata(key).map_err(|e| {
        format!(
            "cannot read the client key {} ({e}); fix: point sslkey= in the URL at a readable PEM key",
            key.display()
        )
    })?;
    let mode = metadata.mode() & 0o777;
    let allowed = if metadata.uid() == 0 { 0o640 } else { 0o600 };
    if mode & !allowed != 0 {
        return Err(format!(
            "the client key {} has permissions {mode:04o}: others may read it; fix: chmod {} {}",
            key.display(),
            if metadata.uid() == 0 { "0640" } else { "0600" },
            key.display()
        ));
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_key_permissions(_key: &Path) -> Result<(), String> {
    Ok(())
}

/// A trust store holding the CA certificates of the PEM file at `path` and nothing else (OpenSSL's
/// connector starts from the system's store, which `set_ca_file` would only add to: review H1).
fn only_roots_of(path: &Path, mode: SslMode) -> Result<X509Store, String> {
    let unreadable = |reason: &dyn std::fmt::Display| {
        format!(
            "cannot read the CA certificate {} for sslmode={} ({reason}); fix: point sslrootcert= in the URL at a readable PEM file",
            path.display(),
            mode.as_str()
        )
    };
    let pem = std::fs::read(path).map_err(|e| unreadable(&e))?;
    let certificates =
        X509::stack_from_pem(&pem).map_err(|_| unreadable(&"not a PEM certificate"))?;
    if certificates.is_empty() {
        return Err(unreadable(&"no certificate in it"));
    }
    let mut store =
        X509StoreBuilder::new().map_err(|e| format!("cannot initialise OpenSSL: {e}"))?;
    for certificate in certificates {
        store.add_cert(certificate).map_err(|e| unreadable(&e))?;
    }
    Ok(store.build())
}

/// The hash of the server's certificate with its signature's digest (SHA-256 for MD5 and SHA-1), as
/// RFC 5929 and PostgreSQL define `tls-server-end-point` (the same rule as postgres-openssl's, which is private).
fn tls_server_end_point(ssl: &openssl::ssl::SslRef) -> Option<Vec<u8>> {
    use openssl::hash::MessageDigest;
    use openssl::nid::Nid;
    let cert = ssl.peer_certificate()?;
    let digest = cert
        .signature_algorithm()
        .object()
        .nid()
        .signature_algorithms()?
        .digest;
    let digest = match digest {
        Nid::MD5 | Nid::SHA1 => MessageDigest::sha256(),
        nid => MessageDigest::from_nid(nid)?,
    };
    cert.digest(digest).ok().map(|bytes| bytes.to_vec())
}

/// Splits `sslmode`/`sslrootcert`/`sslcert`/`sslkey`/`require_auth` off a libpq URL (`postgres://...?sslmode=...`) or key=value string
/// (`host=... sslmode=...`). Returns the rest, ready for tokio-postgres, with its sslmode set to what
/// tokio-postgres understands. Never puts the URL into an error: it may hold a password.
pub fn split_tls_settings(url: &str) -> Result<(String, TlsSettings), String> {
    let mut settings = TlsSettings::default();
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        match key {
            "sslmode" => settings.mode = SslMode::parse(value)?,
            "sslrootcert" => settings.root_cert = Some(PathBuf::from(value)),
            "sslcert" => settings.client_cert = Some(PathBuf::from(value)),
            "sslkey" => settings.client_key = Some(PathBuf::from(value)),
            "require_auth" => settings.require_auth = RequireAuth::parse(value)?,
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            if !take(key, &value)? {
                kept.push(pair);
            }
        }
        if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (key, value) = word.split_once('=').unwrap_or((word, ""));
            if !take(key.trim(), value.trim_matches('\''))? {
                kept.push(word);
            }
        }
        kept.join(" ")
    };
    Ok((rest, settings))
}

/// tokio-postgres's own sslmode for a libpq mode: it negotiates, our connector verifies.
pub fn driver_ssl_mode(mode: SslMode) -> tokio_postgres::config::SslMode {
    match mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_ssl_settings_out_of_urls() {
        let (rest, tls) = split_tls_settings(
            "postgres://u:p@db:5432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.crt",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@db:5432/app?application_name=x");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/etc/ca.crt")));

        let (rest, tls) = split_tls_settings("postgres://u@db/app").unwrap();
        assert_eq!(rest, "postgres://u@db/app");
        assert_eq!(tls, TlsSettings::default());

        let (rest, tls) =
            split_tls_settings("host=db user=u sslmode='verify-ca' sslrootcert=/ca.pem dbname=app")
                .unwrap();
        assert_eq!(rest, "host=db user=u dbname=app");
        assert_eq!(tls.mode, SslMode::VerifyCa);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/ca.pem")));

        let (rest, tls) =
            split_tls_settings("postgres://u@db/app?require_auth=scram-sha-256&sslmode=require")
                .unwrap();
        assert_eq!(rest, "postgres://u@db/app");
        assert!(tls.require_auth.is_given());
        let err = split_tls_settings("postgres://u:secret@db/app?require_auth=scram").unwrap_err();
        assert!(
            err.contains("require_auth") && !err.contains("secret"),
            "{err}"
        );

        let (rest, tls) = split_tls_settings(
            "postgres://u@db/app?sslcert=%2Fc%2Fclient.crt&sslkey=/c/client.key&sslmode=verify-full",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@db/app");
        assert_eq!(tls.client_cert, Some(PathBuf::from("/c/client.crt")));
        assert_eq!(tls.client_key, Some(PathBuf::from("/c/client.key")));
    }

    #[test]
    fn a_missing_client_certificate_names_sslcert() {
        let tls = TlsSettings {
            mode: SslMode::Require,
            client_cert: Some(PathBuf::from("/nonexistent/client.crt")),
            client_key: Some(PathBuf::from("/nonexistent/client.key")),
            ..TlsSettings::default()
        };
        let err = tls.ssl_connector().map(|_| ()).unwrap_err();
        assert!(
            err.contains("sslcert=") && err.contains("/nonexistent/client.crt"),
            "{err}"
        );
    }

    #[test]
    fn refuses_unknown_modes_without_repeating_the_url() {
        let err = split_tls_settings("postgres://u:secret@db/app?sslmode=allow").unwrap_err();
        assert!(err.contains("sslmode=allow"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        assert!(split_tls_settings("postgres://db/app?sslmode=verify").is_err());
    }

    #[test]
    fn verifies_the_chain_when_libpq_would() {
        let with = |mode, root: Option<&str>| TlsSettings {
            mode,
            root_cert: root.map(PathBuf::from),
            ..TlsSettings::default()
        };
        assert!(!with(SslMode::Prefer, Some("/ca")).verifies_chain());
        if default_root_cert().is_none_or(|path| !path.exists()) {
            assert!(!with(SslMode::Require, None).verifies_chain());
        }
        assert!(with(SslMode::Require, Some("/ca")).verifies_chain());
        assert!(with(SslMode::VerifyCa, None).verifies_chain());
        let err = with(SslMode::VerifyFull, Some("/nonexistent/ca.crt"))
            .ssl_connector()
            .err()
            .unwrap();
        assert!(
            err.contains("/nonexistent/ca.crt") && err.contains("sslrootcert"),
            "{err}"
        );
    }

    #[test]
    fn the_system_store_is_trusted_only_when_asked_for_and_with_the_host_name_checked() {
        let system = |mode| TlsSettings {
            mode,
            root_cert: Some(PathBuf::from(SYSTEM_ROOTS)),
            ..TlsSettings::default()
        };
        assert!(system(SslMode::VerifyFull).ssl_connector().is_ok());
        for weak in [SslMode::VerifyCa, SslMode::Require] {
            let err = system(weak).ssl_connector().err().unwrap();
            assert!(err.contains("sslmode=verify-full"), "{err}");
        }
    }
}
