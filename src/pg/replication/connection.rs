//! Replication-mode connection on `postgres-protocol` + tokio: startup with `replication=database`,
//! authentication (trust, cleartext, md5, SCRAM-SHA-256; what to answer is decided by `auth`), simple-query commands (IDENTIFY_SYSTEM,
//! CREATE_REPLICATION_SLOT, START_REPLICATION) and the CopyBoth stream that follows. Owns the socket and
//! framing only; what the stream's messages mean is decided by the pipeline.

use std::time::SystemTime;

use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::{backend, frontend};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, TargetSessionAttrs};

use super::auth::{Answer, AuthError, Authentication, Channel, Request};
use super::protocol::{self, ServerMessage};
use crate::lsn::Lsn;
use crate::pg::require_auth::RequireAuth;
use crate::pg::tls::SslMode;
use crate::pg::version::ServerVersion;
use crate::pg::PgUrl;

trait Socket: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Socket for T {}

/// Session settings sent in the startup packet, as PostgreSQL's own subscriber does, so pgoutput's text
/// values have one known format (bytea in hex, whatever the server's default).
const SESSION_OPTIONS: &str =
    "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3 -c TimeZone=UTC -c bytea_output=hex";

/// A failure of the replication connection, from connecting to the end of the stream.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    /// No socket could be opened (the error of the last address tried).
    #[error("cannot connect to PostgreSQL at {target}: {source}")]
    Connect {
        /// The address tried: host:port, or the Unix socket's path.
        target: String,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("replication connection I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The server closed the connection or ended the CopyBoth stream.
    #[error("PostgreSQL ended the replication stream or closed the connection")]
    Closed,
    /// An ErrorResponse from the server.
    #[error("{severity} {code}: {message}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Server {
        /// Severity as the server sends it (e.g. ERROR, FATAL).
        severity: String,
        /// SQLSTATE, e.g. 55006 (object in use).
        code: String,
        /// The server's primary message.
        message: String,
        /// The server's detail message, if it sent one.
        detail: Option<String>,
    },
    /// The server's messages did not follow the protocol (or a reply could not be parsed).
    #[error("replication protocol error: {0}")]
    Protocol(String),
    /// The server asks for something outboxd does not support (an authentication method).
    #[error("{0}")]
    Unsupported(String),
    /// `--database-password-command` gave no password (the message names the program and why).
    #[error("{0}")]
    PasswordCommand(String),
    /// TLS could not be set up as the URL's sslmode requires.
    #[error("TLS with sslmode={}: {message}", .mode.as_str())]
    Tls {
        /// The URL's sslmode.
        mode: SslMode,
        /// What failed: the handshake or certificate check, or a server without TLS.
        message: String,
    },
    /// Authentication was refused (by outboxd: the server did not authenticate itself as the URL asks) or
    /// cannot go on.
    #[error(transparent)]
    Auth(#[from] AuthError),
}

impl ReplicationError {
    /// SQLSTATE of a server error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ReplicationError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The server's SQLSTATE, to compare with `tokio_postgres::error::SqlState`'s constants.
    pub fn sqlstate(&self) -> Option<tokio_postgres::error::SqlState> {
        self.code().map(tokio_postgres::error::SqlState::from_code)
    }
}

/// Result of IDENTIFY_SYSTEM.
#[derive(Debug, Clone)]
pub struct SystemIdentity {
    /// The cluster's system identifier.
    pub system_id: String,
    /// The server's current timeline (0 if the reply held none).
    pub timeline: u32,
    /// The server's current WAL flush position.
    pub xlog_position: Lsn,
    /// The connection's database (`None` only on a physical replication connection).
    pub database: Option<String>,
}

/// Result of CREATE_REPLICATION_SLOT with an exported snapshot.
#[derive(Debug, Clone)]
pub struct CreatedSlot {
    /// Where the new slot became consistent: the earliest position it can stream from.
    pub consistent_point: Lsn,
    /// Name of the exported snapshot, for `SET TRANSACTION SNAPSHOT`.
    pub snapshot_name: String,
}

/// A replication connection before START_REPLICATION.
pub struct ReplicationConnection {
    socket: Box<dyn Socket>,
    read_buf: BytesMut,
    write_buf: BytesMut,
}

impl ReplicationConnection {
    /// Connects and authenticates in `replication=database` mode.
    pub async fn connect(url: &PgUrl) -> Result<Self, ReplicationError> {
        let config = url
            .fresh_config()
            .await
            .map_err(ReplicationError::PasswordCommand)?;
        let config = config.as_ref();
        // As libpq: hosts in order, each until one answers whose session is what `target_session_attrs`
        // asks for (read-write: not a standby, nor a server with default_transaction_read_only).
        let mut first_host = 0;
        let mut mismatch = None;
        loop {
            let (opened, index, target) = match open_socket(config, first_host).await {
                Ok(found) => found,
                Err(error) => return Err(mismatch.unwrap_or(error)),
            };
            first_host = index + 1;
            let wanted = config.get_target_session_attrs();
            // A host that fails (TLS, authentication, starting up) or whose session does not fit: the next
            // one, as tokio-postgres does for the SQL connection; the last failure is returned.
            match Self::start_on(opened, config, url).await {
                Ok(mut conn) => match conn.session_fits(wanted).await {
                    Ok(true) => return Ok(conn),
                    Ok(false) => {
                        mismatch = Some(ReplicationError::Connect {
                            target,
                            source: std::io::Error::other(format!(
                            "the server's session does not match target_session_attrs ({wanted:?})"
                        )),
                        })
                    }
                    Err(error) => mismatch = Some(error),
                },
                Err(error) => mismatch = Some(error),
            }
        }
    }

    /// TLS (as the URL asks), startup and authentication on an opened socket.
    async fn start_on(
        opened: OpenSocket,
        config: &tokio_postgres::Config,
        url: &PgUrl,
    ) -> Result<Self, ReplicationError> {
        let (socket, channel) = match opened {
            OpenSocket::Tcp { stream, host } => negotiate_tls(stream, &host, url).await?,
            // libpq does not use TLS on Unix-domain sockets either.
            #[cfg(unix)]
            OpenSocket::Unix(stream) => (Box::new(stream) as Box<dyn Socket>, Channel::Plain),
        };
        let mut conn = ReplicationConnection {
            socket,
            read_buf: BytesMut::with_capacity(64 * 1024),
            write_buf: BytesMut::with_capacity(1024),
        };
        conn.startup(config, &url.tls.require_auth, channel).await?;
        Ok(conn)
    }

    /// Whether the session is what `target_session_attrs` asks for (`transaction_read_only`, as libpq reads it).
    async fn session_fits(&mut self, wanted: TargetSessionAttrs) -> Result<bool, ReplicationError> {
        let read_only = match wanted {
            TargetSessionAttrs::ReadWrite => false,
            TargetSessionAttrs::ReadOnly => true,
            _ => return Ok(true),
        };
        let rows = self.simple_query("SHOW transaction_read_only").await?;
        let value = rows.first().and_then(|row| row.first().cloned().flatten());
        Ok((value.as_deref() == Some("on")) == read_only)
    }

    /// Startup and authentication (see [`Authentication`]). `channel`: the connection's TLS, whose
    /// `tls-server-end-point` data binds SCRAM to it (SCRAM-SHA-256-PLUS) when the server offers it; the
    /// URL's `channel_binding` (libpq's: disable, prefer, require) is enforced as libpq does.
    async fn startup(
        &mut self,
        config: &tokio_postgres::Config,
        require_auth: &RequireAuth,
        channel: Channel,
    ) -> Result<(), ReplicationError> {
        let user = config.get_user().unwrap_or("postgres");
        let database = config.get_dbname().unwrap_or(user);
        let mut params = vec![
            ("user", user),
            ("database", database),
            ("replication", "database"),
            ("client_encoding", "UTF8"),
            ("options", SESSION_OPTIONS),
        ];
        params.push((
            "application_name",
            config.get_application_name().unwrap_or("outboxd"),
        ));
        frontend::startup_message(params.iter().copied(), &mut self.write_buf)?;
        self.flush().await?;

        let mut authentication = Authentication::new(
            user,
            config.get_password(),
            config.get_channel_binding(),
            require_auth,
            channel,
        );
        loop {
            let message = self.next_backend_message().await?;
            let mut mechanisms = Vec::new();
            let request = match &message {
                backend::Message::AuthenticationOk => Request::Ok,
                backend::Message::AuthenticationCleartextPassword => Request::Cleartext,
                backend::Message::AuthenticationMd5Password(body) => Request::Md5(body.salt()),
                backend::Message::AuthenticationSasl(body) => {
                    let mut offered = body.mechanisms();
                    while let Some(mechanism) = offered.next()? {
                        mechanisms.push(mechanism);
                    }
                    Request::Sasl(mechanisms)
                }
                backend::Message::AuthenticationSaslContinue(body) => {
                    Request::SaslContinue(body.data())
                }
                backend::Message::AuthenticationSaslFinal(body) => Request::SaslFinal(body.data()),
                backend::Message::ErrorResponse(body) => return Err(server_error(body)),
                backend::Message::AuthenticationKerberosV5
                | backend::Message::AuthenticationScmCredential
                | backend::Message::AuthenticationGss
                | backend::Message::AuthenticationSspi => {
                    return Err(ReplicationError::Unsupported(
                        "the server requests GSS/SSPI/Kerberos authentication, which outboxd does not support; use scram-sha-256 or md5 in pg_hba.conf".into(),
                    ))
                }
                _ => return Err(protocol_error("unexpected message during authentication")),
            };
            match authentication.answer(request)? {
                Answer::Authenticated => break,
                Answer::Wait => continue,
                Answer::Password(password) => {
                    frontend::password_message(&password, &mut self.write_buf)?
                }
                Answer::SaslInitial(mechanism, first) => {
                    frontend::sasl_initial_response(mechanism, &first, &mut self.write_buf)?
                }
                Answer::SaslResponse(last) => frontend::sasl_response(&last, &mut self.write_buf)?,
            }
            self.flush().await?;
        }
        // ParameterStatus, BackendKeyData, ... until ReadyForQuery.
        loop {
            match self.next_backend_message().await? {
                backend::Message::ReadyForQuery(_) => return Ok(()),
                backend::Message::ErrorResponse(body) => return Err(server_error(&body)),
                _ => {}
            }
        }
    }

    /// Runs a replication command and returns its rows as text.
    pub async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ReplicationError> {
        frontend::query(sql, &mut self.write_buf)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            match self.next_backend_message().await? {
                backend::Message::DataRow(body) => {
                    let buffer = body.buffer();
                    let row = body
                        .ranges()
                        .map(|range| {
                            Ok(range.map(|r| String::from_utf8_lossy(&buffer[r]).into_owned()))
                        })
                        .collect()?;
                    rows.push(row);
                }
                backend::Message::ErrorResponse(body) => error = Some(server_error(&body)),
                backend::Message::ReadyForQuery(_) => break,
                _ => {}
            }
        }
        match error {
            Some(error) => Err(error),
            None => Ok(rows),
        }
    }

    /// Runs IDENTIFY_SYSTEM: the cluster's identity, its timeline and its WAL flush position.
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, ReplicationError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .ok_or_else(|| protocol_error("IDENTIFY_SYSTEM returned no row"))?;
        let field = |i: usize| row.get(i).cloned().flatten();
        let xlog_position = field(2)
            .ok_or_else(|| protocol_error("IDENTIFY_SYSTEM returned no xlogpos"))?
            .parse::<Lsn>()
            .map_err(|e| protocol_error(&e.to_string()))?;
        Ok(SystemIdentity {
            system_id: field(0).unwrap_or_default(),
            timeline: field(1).and_then(|t| t.parse().ok()).unwrap_or(0),
            xlog_position,
            database: field(3),
        })
    }

    /// Runs TIMELINE_HISTORY: the content of `timeline`'s history file (its ancestors and where each ended).
    /// Timeline 1 has none.
    pub async fn timeline_history(&mut self, timeline: u32) -> Result<String, ReplicationError> {
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        rows.first()
            .and_then(|row| row.get(1).cloned().flatten())
            .ok_or_else(|| protocol_error("TIMELINE_HISTORY returned no content"))
    }

    /// [`crate::pg::SERVER_STARTED_AT`] over this connection: which server it reached.
    pub async fn server_started_at(&mut self) -> Result<String, ReplicationError> {
        let rows = self.simple_query(crate::pg::SERVER_STARTED_AT).await?;
        rows.first()
            .and_then(|row| row.first().cloned().flatten())
            .ok_or_else(|| protocol_error("pg_postmaster_start_time() returned nothing"))
    }

    /// Whether the server is a standby in recovery (a walsender of a database connection runs plain SQL).
    pub async fn in_recovery(&mut self) -> Result<bool, ReplicationError> {
        let rows = self.simple_query("SELECT pg_is_in_recovery()").await?;
        let value = rows.first().and_then(|row| row.first().cloned().flatten());
        Ok(value.as_deref() == Some("t"))
    }

    /// Creates a logical slot using pgoutput and exports its snapshot. `slot` must be a validated name.
    /// The snapshot stays importable (`SET TRANSACTION SNAPSHOT`) until this connection runs another command:
    /// rows visible in it are exactly the rows the new slot will never send.
    /// On `version` 17+, `failover` makes it a failover slot (synchronised to standbys that ask for it).
    pub async fn create_logical_slot(
        &mut self,
        slot: &str,
        version: ServerVersion,
        failover: bool,
    ) -> Result<CreatedSlot, ReplicationError> {
        let rows = self
            .simple_query(&version.create_slot_command(slot, failover))
            .await?;
        let field = |i: usize| rows.first().and_then(|row| row.get(i).cloned().flatten());
        let consistent_point = field(1)
            .ok_or_else(|| protocol_error("CREATE_REPLICATION_SLOT returned no consistent_point"))?
            .parse::<Lsn>()
            .map_err(|e| protocol_error(&e.to_string()))?;
        let snapshot_name = field(2)
            .ok_or_else(|| protocol_error("CREATE_REPLICATION_SLOT returned no snapshot name"))?;
        Ok(CreatedSlot {
            consistent_point,
            snapshot_name,
        })
    }

    /// Makes the existing slot `slot` (a validated name) a failover slot or not (PostgreSQL 17+). The slot
    /// must not be in use by another walsender.
    pub async fn alter_slot_failover(
        &mut self,
        slot: &str,
        failover: bool,
    ) -> Result<(), ReplicationError> {
        self.simple_query(&ServerVersion::alter_failover_command(slot, failover))
            .await?;
        Ok(())
    }

    /// Starts streaming pgoutput (proto 1, with logical decoding messages: PostgreSQL 14+) from `start` for
    /// `publication`. Names must be validated identifiers.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start: Lsn,
        publication: &str,
    ) -> Result<ReplicationStream, ReplicationError> {
        let sql = format!(
            "START_REPLICATION SLOT \"{slot}\" LOGICAL {start} (proto_version '1', publication_names '\"{publication}\"', messages 'true')"
        );
        frontend::query(&sql, &mut self.write_buf)?;
        self.flush().await?;
        loop {
            // CopyBothResponse ('W') is not parsed by postgres-protocol: recognise it from its header.
            if let Some(header) = backend::Header::parse(&self.read_buf)? {
                let total = header.len() as usize + 1;
                if header.tag() == b'W' && self.read_buf.len() >= total {
                    let _ = self.read_buf.split_to(total);
                    return Ok(ReplicationStream {
                        conn: self,
                        skipping: 0,
                    });
                }
            }
            if let Some(message) = parse_message(&mut self.read_buf, MAX_MESSAGE_BYTES)? {
                match message {
                    backend::Message::ErrorResponse(body) => {
                        let error = server_error(&body);
                        return Err(error);
                    }
                    backend::Message::NoticeResponse(_) => continue,
                    _ => return Err(protocol_error("unexpected reply to START_REPLICATION")),
                }
            }
            self.fill().await?;
        }
    }

    async fn next_backend_message(&mut self) -> Result<backend::Message, ReplicationError> {
        loop {
            if let Some(message) = parse_message(&mut self.read_buf, MAX_MESSAGE_BYTES)? {
                return Ok(message);
            }
            self.fill().await?;
        }
    }

    /// Reads more bytes. Cancel-safe: a cancelled read loses nothing.
    async fn fill(&mut self) -> Result<(), ReplicationError> {
        if self.read_buf.capacity() - self.read_buf.len() < 8 * 1024 {
            self.read_buf.reserve(64 * 1024);
        }
        let n = self.socket.read_buf(&mut self.read_buf).await?;
        if n == 0 {
            return Err(ReplicationError::Closed);
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), ReplicationError> {
        let data = self.write_buf.split();
        self.socket.write_all(&data).await?;
        self.socket.flush().await?;
        Ok(())
    }
}

/// The CopyBoth stream after START_REPLICATION.
pub struct ReplicationStream {
    conn: ReplicationConnection,
    /// Bytes still to discard of a logical decoding message too long to be outboxd's ([`oversize_message`]).
    skipping: usize,
}

impl ReplicationStream {
    /// Waits for the next XLogData or keepalive. Cancel-safe (safe inside `tokio::select!`).
    pub async fn next_message(&mut self) -> Result<ServerMessage, ReplicationError> {
        loop {
            if self.skipping > 0 {
                let discard = self.skipping.min(self.conn.read_buf.len());
                let _ = self.conn.read_buf.split_to(discard);
                self.skipping -= discard;
                if self.skipping > 0 {
                    self.conn.read_buf.clear();
                    self.conn.fill().await?;
                    continue;
                }
            }
            if let Some(total) = oversize_message(&self.conn.read_buf) {
                tracing::warn!(
                    bytes = total,
                    "skipped a logical decoding message of {total} bytes without reading it into memory: outboxd's own are a few hundred bytes (any login may emit one with pg_logical_emit_message)"
                );
                self.skipping = total;
                continue;
            }
            if let Some(message) = parse_message(&mut self.conn.read_buf, MAX_COPY_DATA_BYTES)? {
                match message {
                    backend::Message::CopyData(body) => {
                        return protocol::decode_server_message(body.into_bytes())
                            .map_err(|e| protocol_error(&e.to_string()));
                    }
                    backend::Message::ErrorResponse(body) => return Err(server_error(&body)),
                    backend::Message::NoticeResponse(_) | backend::Message::ParameterStatus(_) => {
                        continue
                    }
                    // CopyDone, CommandComplete, ReadyForQuery: the server ended the stream (e.g. shutting down).
                    _ => return Err(ReplicationError::Closed),
                }
            }
            self.conn.fill().await?;
        }
    }

    /// Sends a standby status update confirming `confirmed` (write = flush = apply).
    pub async fn send_status(&mut self, confirmed: Lsn) -> Result<(), ReplicationError> {
        let update = protocol::encode_status_update(confirmed, SystemTime::now(), false);
        frontend::CopyData::new(update)?.write(&mut self.conn.write_buf);
        self.conn.flush().await
    }

    /// Ends the stream politely (CopyDone + Terminate); errors are irrelevant at this point.
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.conn.write_buf);
        frontend::terminate(&mut self.conn.write_buf);
        let _ = self.conn.flush().await;
    }
}

enum OpenSocket {
    Tcp {
        stream: TcpStream,
        host: String,
    },
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

/// Asks for TLS (SSLRequest) unless sslmode=disable and upgrades the socket when the server agrees; a
/// server without TLS is accepted only for sslmode=prefer.
/// The socket, TLS or not as `sslmode` says, and the TLS channel's binding data.
async fn negotiate_tls(
    mut stream: TcpStream,
    host: &str,
    url: &PgUrl,
) -> Result<(Box<dyn Socket>, Channel), ReplicationError> {
    let mode = url.tls.mode;
    if mode == SslMode::Disable {
        return Ok((Box::new(stream), Channel::Plain));
    }
    let mut request = BytesMut::new();
    frontend::ssl_request(&mut request);
    stream.write_all(&request).await?;
    let answer = stream.read_u8().await?;
    let tls_error = |message: String| ReplicationError::Tls { mode, message };
    match answer {
        b'S' => {
            let (stream, binding) = url
                .tls
                .handshake(&url.ssl, host, stream)
                .await
                .map_err(tls_error)?;
            Ok((Box::new(stream), Channel::Tls { end_point: binding }))
        }
        b'N' if mode.allows_plaintext() => Ok((Box::new(stream), Channel::Plain)),
        b'N' => Err(tls_error("server does not support TLS".into())),
        other => Err(protocol_error(&format!(
            "unexpected answer {other:#x} to the TLS request"
        ))),
    }
}

/// Applies the URL's TCP keepalives and `tcp_user_timeout` (as libpq and tokio-postgres do for SQL
/// connections): a server gone silent (node lost, network partitioned) fails the stream within about that
/// timeout, since status updates go out every second, instead of the operating system's two hours.
fn detect_dead_peer(stream: &TcpStream, config: &tokio_postgres::Config) -> std::io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    if config.get_keepalives() {
        let mut keepalive = socket2::TcpKeepalive::new().with_time(config.get_keepalives_idle());
        if let Some(interval) = config.get_keepalives_interval() {
            keepalive = keepalive.with_interval(interval);
        }
        if let Some(retries) = config.get_keepalives_retries() {
            keepalive = keepalive.with_retries(retries);
        }
        socket.set_tcp_keepalive(&keepalive)?;
    }
    #[cfg(target_os = "linux")]
    if let Some(timeout) = config.get_tcp_user_timeout() {
        socket.set_tcp_user_timeout(Some(*timeout))?;
    }
    Ok(())
}

/// Opens the socket to the first host from `first_host` on that answers, as tokio-postgres does for SQL
/// connections: `hostaddr`, where given, is the address connected to (no name lookup), `host` the name the
/// certificate must carry. Returns the socket, the host's index and its address.
async fn open_socket(
    config: &tokio_postgres::Config,
    first_host: usize,
) -> Result<(OpenSocket, usize, String), ReplicationError> {
    let addrs = config.get_hostaddrs();
    let default_host = [Host::Tcp(
        addrs
            .first()
            .map_or_else(|| "localhost".to_string(), |addr| addr.to_string()),
    )];
    let hosts = if config.get_hosts().is_empty() {
        &default_host[..]
    } else {
        config.get_hosts()
    };
    let ports = config.get_ports();
    let mut last_error = None;
    for (index, host) in hosts.iter().enumerate().skip(first_host) {
        let port = ports
            .get(index)
            .or_else(|| ports.first())
            .copied()
            .unwrap_or(5432);
        let (target, result): (String, std::io::Result<OpenSocket>) = match host {
            Host::Tcp(name) => {
                let target = format!("{name}:{port}");
                let connected = match addrs.get(index) {
                    Some(addr) => TcpStream::connect((*addr, port)).await,
                    None => TcpStream::connect((name.as_str(), port)).await,
                };
                let result = connected.and_then(|stream| {
                    let _ = stream.set_nodelay(true);
                    detect_dead_peer(&stream, config)?;
                    Ok(OpenSocket::Tcp {
                        stream,
                        host: name.clone(),
                    })
                });
                (target, result)
            }
            #[cfg(unix)]
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                let target = path.display().to_string();
                let result = tokio::net::UnixStream::connect(&path)
                    .await
                    .map(OpenSocket::Unix);
                (target, result)
            }
        };
        match result {
            Ok(socket) => return Ok((socket, index, target)),
            Err(source) => last_error = Some(ReplicationError::Connect { target, source }),
        }
    }
    Err(last_error.unwrap_or_else(|| ReplicationError::Connect {
        target: "localhost:5432".into(),
        source: std::io::ErrorKind::NotFound.into(),
    }))
}

/// The longest logical decoding message (pgoutput `M`) outboxd reads: its own hand-off notices are a few
/// hundred bytes. Any login may emit one (`pg_logical_emit_message`), of any size, into every slot of the
/// database: a longer one is discarded as it arrives, never held in memory (security review follow-up).
const MAX_LOGICAL_MESSAGE_BYTES: usize = 64 * 1024;

/// Pure: the length of the message at the head of `buf` (type byte included) when it is a CopyData holding
/// XLogData whose pgoutput message is a logical decoding message (`M`) longer than
/// [`MAX_LOGICAL_MESSAGE_BYTES`]; `None` for anything else, or before its first 31 bytes have arrived.
fn oversize_message(buf: &[u8]) -> Option<usize> {
    // 'd', Int32 length, 'w', Int64 start, Int64 end, Int64 clock, then the pgoutput message's type byte.
    const PGOUTPUT_TYPE_AT: usize = 1 + 4 + 1 + 8 + 8 + 8;
    let (&tag, rest) = buf.split_first()?;
    let length = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let is_message =
        tag == b'd' && buf.get(5) == Some(&b'w') && buf.get(PGOUTPUT_TYPE_AT) == Some(&b'M');
    (is_message && length > MAX_LOGICAL_MESSAGE_BYTES).then_some(length + 1)
}

/// The largest message outboxd takes from the server other than CopyData (errors, notices, command replies).
const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// The largest CopyData: one decoded change, whose values PostgreSQL keeps under 1 GiB each.
const MAX_COPY_DATA_BYTES: usize = (1 << 30) + (1 << 20);

/// The next whole message in `buf`, once all of it has arrived. A declared length is not trusted: nothing is
/// reserved for a message before its bytes come (`fill` grows the buffer as they do), and a message longer
/// than the protocol needs is refused: CopyData up to `copy_data_limit` (long only inside the replication
/// stream), anything else up to [`MAX_MESSAGE_BYTES`].
fn parse_message(
    buf: &mut BytesMut,
    copy_data_limit: usize,
) -> Result<Option<backend::Message>, ReplicationError> {
    let Some(header) = backend::Header::parse(buf)? else {
        return Ok(None);
    };
    let total = header.len() as usize + 1;
    let limit = if header.tag() == b'd' {
        copy_data_limit
    } else {
        MAX_MESSAGE_BYTES
    };
    if total > limit {
        return Err(protocol_error(&format!(
            "the server announced a message of {total} bytes (type '{}'), more than the {limit} bytes outboxd takes",
            char::from(header.tag()).escape_default()
        )));
    }
    if buf.len() < total {
        return Ok(None);
    }
    Ok(backend::Message::parse(buf)?)
}

fn protocol_error(what: &str) -> ReplicationError {
    ReplicationError::Protocol(what.to_string())
}

fn server_error(body: &backend::ErrorResponseBody) -> ReplicationError {
    let (mut severity, mut code, mut message, mut detail) =
        (String::new(), String::new(), String::new(), None);
    let mut fields = body.fields();
    while let Ok(Some(field)) = fields.next() {
        let value = || String::from_utf8_lossy(field.value_bytes()).into_owned();
        match field.type_() {
            b'S' => severity = value(),
            b'C' => code = value(),
            b'M' => message = value(),
            b'D' => detail = Some(value()),
            _ => {}
        }
    }
    ReplicationError::Server {
        severity,
        code,
        message,
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy_data(pgoutput_type: u8, length: u32) -> Vec<u8> {
        let mut buf = vec![b'd'];
        buf.extend_from_slice(&length.to_be_bytes());
        buf.push(b'w');
        buf.extend_from_slice(&[0; 24]);
        buf.push(pgoutput_type);
        buf
    }

    #[test]
    fn only_a_long_logical_decoding_message_is_skipped_and_whole() {
        assert_eq!(
            oversize_message(&copy_data(b'M', 300 << 20)),
            Some((300 << 20) + 1)
        );
        assert_eq!(
            oversize_message(&copy_data(b'M', 200)),
            None,
            "a notice of outboxd's size"
        );
        assert_eq!(
            oversize_message(&copy_data(b'I', 300 << 20)),
            None,
            "a row is never skipped"
        );
        let mut keepalive = copy_data(b'M', 300 << 20);
        keepalive[5] = b'k';
        assert_eq!(oversize_message(&keepalive), None);
        assert_eq!(
            oversize_message(&copy_data(b'M', 300 << 20)[..20]),
            None,
            "not all of its head yet"
        );
    }

    fn header(tag: u8, len: u32) -> BytesMut {
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&[tag]);
        buf.extend_from_slice(&len.to_be_bytes());
        buf
    }

    #[test]
    fn a_message_announced_longer_than_the_protocol_needs_is_refused_unread() {
        // Review L8: a server (or a man in the middle) announcing 1 GiB made outboxd reserve it.
        let mut announced = header(b'R', 1 << 30);
        let Err(error) = parse_message(&mut announced, MAX_COPY_DATA_BYTES) else {
            panic!("a 1 GiB authentication message was taken")
        };
        assert!(error.to_string().contains("more than the"), "{error}");
        assert!(announced.capacity() < 1 << 20);
        // CopyData may be long (a change with large values), but room grows only as its bytes arrive.
        let mut copy_data = header(b'd', 1 << 30);
        assert!(parse_message(&mut copy_data, MAX_COPY_DATA_BYTES)
            .unwrap()
            .is_none());
        assert!(copy_data.capacity() < 1 << 20);
        let mut too_long = header(b'd', (MAX_COPY_DATA_BYTES + 1) as u32);
        assert!(parse_message(&mut too_long, MAX_COPY_DATA_BYTES).is_err());
        // Outside the stream (authentication, commands) CopyData is short too.
        let mut before_the_stream = header(b'd', 1 << 30);
        assert!(parse_message(&mut before_the_stream, MAX_MESSAGE_BYTES).is_err());
    }

    #[test]
    fn a_whole_message_is_parsed_once_it_arrived() {
        let mut buf = header(b'R', 8);
        assert!(parse_message(&mut buf, MAX_MESSAGE_BYTES)
            .unwrap()
            .is_none());
        buf.extend_from_slice(&0u32.to_be_bytes());
        assert!(matches!(
            parse_message(&mut buf, MAX_MESSAGE_BYTES).unwrap(),
            Some(backend::Message::AuthenticationOk)
        ));
        assert!(buf.is_empty());
    }
}
