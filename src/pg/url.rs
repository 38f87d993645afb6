//! A PostgreSQL connection target parsed from a libpq URL or key=value string, with the TLS policy
//! (`sslmode`) tokio-postgres cannot express and its connectors built once. Parsing and TLS only: opening
//! connections is `pg`'s.

use std::time::Duration;

use super::{guarded_tls, tls};

/// A PostgreSQL connection target: tokio-postgres's config plus the TLS policy (libpq `sslmode`) that
/// tokio-postgres cannot express, with its connector built once at start-up.
#[derive(Clone)]
pub struct PgUrl {
    /// tokio-postgres's settings from the URL, its `ssl_mode` derived from `tls.mode`.
    pub config: tokio_postgres::Config,
    /// The URL's `sslmode` and `sslrootcert`.
    pub tls: tls::TlsSettings,
    /// Built once at start-up: the replication connection's TLS, and `connector`'s.
    pub ssl: openssl::ssl::SslConnector,
    connector: guarded_tls::Connector,
    /// `--database-password-command`: run before every connection for a fresh password.
    pub password_command: Option<super::password_command::PasswordCommand>,
}

/// A SQL connection's driver half, to be polled (or awaited) on a task of its own.
pub type Connection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    guarded_tls::Stream<postgres_openssl::TlsStream<tokio_postgres::Socket>>,
>;

impl PgUrl {
    /// Parses a libpq URL or key=value string given as `setting`. Errors are whole messages naming the
    /// setting and the fix; they never repeat the URL (it may hold a password).
    pub fn parse(setting: &str, url: &str) -> std::result::Result<Self, String> {
        let invalid = |e: &dyn std::fmt::Display| {
            format!("{setting} is not a valid PostgreSQL URL ({e}); expected postgres://user:password@host:5432/database[?sslmode=verify-full&sslrootcert=/path/ca.crt]")
        };
        let (rest, tls) = tls::split_tls_settings(url).map_err(|e| invalid(&e))?;
        if tls.require_auth.is_given() && tls.mode.allows_plaintext() {
            return Err(format!(
                "{setting} gives require_auth with sslmode={}: outboxd checks the server's authentication method inside TLS, and without TLS a man in the middle could still read the session; fix: add sslmode=verify-full&sslrootcert=/path/to/ca.crt (or at least sslmode=require)",
                tls.mode.as_str()
            ));
        }
        let mut config = rest
            .parse::<tokio_postgres::Config>()
            .map_err(|e| invalid(&e))?;
        config.ssl_mode(tls::driver_ssl_mode(tls.mode));
        let ssl = tls.ssl_connector().map_err(|e| format!("{setting}: {e}"))?;
        let connector =
            guarded_tls::Connector::new(tls.connector(ssl.clone()), tls.require_auth.clone());
        Ok(PgUrl {
            config,
            tls,
            ssl,
            connector,
            password_command: None,
        })
    }

    /// A warning for TLS that does not authenticate the server (`prefer`, or `require` without a root
    /// certificate) to a host off this machine: it keeps listeners out, not a man in the middle, who can ask
    /// for the password in the clear or feed forged data. `None` when the server is verified, when TLS is
    /// off on purpose, or on loopback and Unix sockets.
    pub fn unverified_tls_warning(&self, setting: &str) -> Option<String> {
        use tokio_postgres::config::Host;
        let unverified = matches!(self.tls.mode, tls::SslMode::Prefer | tls::SslMode::Require)
            && !self.tls.authenticates_server();
        let remote = self.config.get_hosts().iter().any(|host| match host {
            Host::Tcp(name) => !is_loopback(name),
            #[cfg(unix)]
            Host::Unix(_) => false,
        });
        (unverified && remote).then(|| {
            format!(
                "{setting} uses sslmode={}: TLS without checking the server's certificate keeps listeners out but not a man in the middle, who could ask for the password or feed forged events; fix: sslmode=verify-full&sslrootcert=/path/to/ca.crt (or sslrootcert=system for a certificate a public CA issued)",
                self.tls.mode.as_str()
            )
        })
    }

    /// The settings to connect with now: with a password command, the URL's settings and the password it
    /// prints (run at each call); otherwise the URL's own. The error names the program, never a password.
    pub async fn fresh_config(
        &self,
    ) -> Result<std::borrow::Cow<'_, tokio_postgres::Config>, String> {
        let Some(command) = &self.password_command else {
            return Ok(std::borrow::Cow::Borrowed(&self.config));
        };
        let password = command.password().await?;
        let mut config = self.config.clone();
        config.password(password);
        Ok(std::borrow::Cow::Owned(config))
    }

    /// The SQL connections' TLS connector for this target.
    pub fn connector(&self) -> guarded_tls::Connector {
        self.connector.clone()
    }

    /// This target with TCP keepalives and `tcp_user_timeout` on the client's socket (so that a peer gone
    /// silent fails the connection within about `user_timeout` instead of the operating system's two hours),
    /// and a connect timeout when the URL gives none.
    pub fn with_dead_peer_detection(
        &self,
        idle: Duration,
        interval: Duration,
        retries: u32,
        user_timeout: Duration,
    ) -> PgUrl {
        let mut url = self.clone();
        url.config
            .keepalives(true)
            .keepalives_idle(idle)
            .keepalives_interval(interval)
            .keepalives_retries(retries)
            .tcp_user_timeout(user_timeout);
        if url.config.get_connect_timeout().is_none() {
            url.config.connect_timeout(user_timeout);
        }
        url
    }
}

/// Whether `host` names this machine (a loopback address, or `localhost`).
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl std::fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // tokio-postgres's Debug redacts the password.
        f.debug_struct("PgUrl")
            .field("config", &self.config)
            .field("tls", &self.tls)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warning(url: &str) -> Option<String> {
        PgUrl::parse("--database-url", url)
            .unwrap()
            .unverified_tls_warning("--database-url")
    }

    #[test]
    fn tls_that_checks_nothing_is_said_at_start_up_unless_the_server_is_this_machine() {
        for weak in ["", "?sslmode=prefer", "?sslmode=require"] {
            let said = warning(&format!("postgres://u:pw@db.internal/app{weak}"));
            assert!(
                said.as_deref()
                    .is_some_and(|w| w.contains("verify-full") && !w.contains("pw")),
                "{weak}: {said:?}"
            );
        }
        assert_eq!(warning("postgres://u@localhost/app?sslmode=require"), None);
        assert_eq!(warning("postgres://u@127.0.0.1/app"), None);
        assert_eq!(
            warning("postgres://u@db.internal/app?sslmode=disable"),
            None
        );
        assert_eq!(
            warning("postgres://u@db.internal/app?sslmode=verify-full&sslrootcert=system"),
            None
        );
    }
}
