//! TLS to PostgreSQL with libpq's sslmode semantics, on the SQL connections and on the replication
//! connection, against a local server with `ssl = on` and a CA made in the test.

use std::time::Duration;

use crate::support::*;

/// Every outboxd backend (SQL and walsender) and whether it uses TLS, once a walsender streams.
async fn outboxd_backends(client: &tokio_postgres::Client) -> Vec<(String, bool)> {
    wait_slot_active(client, "outboxd").await;
    client
        .query(
            "SELECT a.backend_type, s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE a.backend_type IN ('client backend', 'walsender') AND a.pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Runs outboxd with `url` until it streams; asserts every connection it opened has TLS = `tls`.
async fn streams_with_tls(url: &str, brokers: &str, tls: bool, client: &tokio_postgres::Client) {
    let mut outboxd = Outboxd::spawn(&run_args(url, brokers));
    let backends = outboxd_backends(client).await;
    assert!(
        backends.iter().any(|(kind, _)| kind == "walsender")
            && backends.iter().any(|(kind, _)| kind == "client backend"),
        "{url}: expected SQL and replication connections, got {backends:?}"
    );
    assert!(
        backends.iter().all(|(_, ssl)| *ssl == tls),
        "{url}: expected TLS={tls} on every connection, got {backends:?}"
    );
    outboxd.kill();
    wait_for_async("the walsender to go", Duration::from_secs(30), || async {
        slot_active(client, "outboxd").await.is_none().then_some(())
    })
    .await;
}

/// Runs outboxd with `database_url` (and optionally a different replication URL) expecting it to stop at
/// once with exit code 1; returns stderr.
fn fails_at_startup(database_url: &str, replication_url: Option<&str>, brokers: &str) -> String {
    fails_at_startup_with_env(database_url, replication_url, brokers, &[])
}

/// [`fails_at_startup`] with extra environment.
fn fails_at_startup_with_env(
    database_url: &str,
    replication_url: Option<&str>,
    brokers: &str,
    env: &[(&str, &str)],
) -> String {
    let mut args = run_args(database_url, brokers);
    args.extend(["--startup-timeout", "30s"]);
    if let Some(url) = replication_url {
        args.extend(["--replication-url", url]);
    }
    let output = run_outboxd_with_env(&args, env);
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    eprintln!("STDERR: {}", stderr.lines().last().unwrap_or_default());
    stderr
}

fn assert_mentions(stderr: &str, needles: &[&str]) {
    for needle in needles {
        assert!(stderr.contains(needle), "expected {needle:?} in:\n{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_sslmode_on_sql_and_replication_connections() {
    let (pg, broker) = migrated_stack();
    let mut client = pg.client().await;
    let brokers = broker.addr();
    let port = pg.port;
    let url =
        |host: &str, query: &str| format!("postgres://postgres@{host}:{port}/postgres?{query}");

    // A server without TLS: require is refused with the fix, prefer falls back to plain.
    let stderr = fails_at_startup(&url("127.0.0.1", "sslmode=require"), None, &brokers);
    assert_mentions(
        &stderr,
        &["does not accept TLS", "sslmode=require", "ssl = on"],
    );
    streams_with_tls(
        &url("127.0.0.1", "sslmode=prefer"),
        &brokers,
        false,
        &client,
    )
    .await;

    let certs = TestCertificates::make(&scratch_dir("certs"));
    pg.enable_tls(&certs).await;
    let ca = certs.ca.display().to_string();
    let other_ca = certs.other_ca.display().to_string();

    // verify-full: chain and host name; events flow end to end.
    let full = url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let outboxd = Outboxd::spawn(&run_args(&full, &brokers));
    let backends = outboxd_backends(&client).await;
    assert!(backends.iter().all(|(_, ssl)| *ssl), "{backends:?}");
    let (committed, rolled_back) = insert_events(&mut client, 0, 20, 10, 5, Some(7)).await;
    verify_fault_free_delivery(&brokers, &committed, &rolled_back, 60, "verify-full");
    drop(outboxd);
    wait_for_async("the walsender to go", Duration::from_secs(30), || async {
        slot_active(&client, "outboxd")
            .await
            .is_none()
            .then_some(())
    })
    .await;

    // verify-ca checks the chain only, so an address not in the certificate is fine.
    let verify_ca = url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}"));
    streams_with_tls(&verify_ca, &brokers, true, &client).await;
    streams_with_tls(
        &url("127.0.0.1", "sslmode=require"),
        &brokers,
        true,
        &client,
    )
    .await;
    streams_with_tls(&url("127.0.0.1", "sslmode=prefer"), &brokers, true, &client).await;
    streams_with_tls(
        &url("127.0.0.1", "sslmode=disable"),
        &brokers,
        false,
        &client,
    )
    .await;

    // verify-full to an address the certificate does not name.
    let wrong_host = url(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let stderr = fails_at_startup(&wrong_host, None, &brokers);
    assert_mentions(
        &stderr,
        &[
            "failed verification",
            "sslmode=verify-full",
            "subjectAltName",
        ],
    );
    assert!(
        !stderr.contains("verify-ca"),
        "the fix never weakens verification (review H1): {stderr}"
    );
    // A CA that did not sign the server's certificate, on the SQL and on the replication connection.
    let wrong_ca = url(
        "localhost",
        &format!("sslmode=verify-ca&sslrootcert={other_ca}"),
    );
    let stderr = fails_at_startup(&wrong_ca, None, &brokers);
    assert_mentions(&stderr, &["failed verification", "sslrootcert"]);
    let stderr = fails_at_startup(&full, Some(&wrong_ca), &brokers);
    assert_mentions(&stderr, &["failed verification", "sslrootcert"]);
    // A root certificate file that does not exist is a configuration error naming the setting.
    let missing = url(
        "localhost",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.crt",
    );
    let stderr = fails_at_startup(&missing, None, &brokers);
    assert_mentions(
        &stderr,
        &["--database-url", "sslrootcert", "/nonexistent/ca.crt"],
    );
}

/// `channel_binding=require` holds on the replication connection too: SCRAM-SHA-256-PLUS over TLS works,
/// and a replication connection the server lets in with a plain password (here through
/// `--replication-url` as another user) is refused at start-up, with the fix, while the SQL connections bind.
#[tokio::test(flavor = "multi_thread")]
async fn channel_binding_is_enforced_on_the_replication_connection() {
    let (pg, broker) = migrated_stack();
    let client = pg.client().await;
    let brokers = broker.addr();
    let certs = TestCertificates::make(&scratch_dir("certs"));
    pg.enable_tls(&certs).await;
    client
        .batch_execute(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE scram_user LOGIN REPLICATION PASSWORD 'pw-scram';
             CREATE ROLE plain_user LOGIN REPLICATION PASSWORD 'pw-plain';
             GRANT SELECT, UPDATE ON outbox_event TO scram_user, plain_user;",
        )
        .await
        .unwrap();
    pg.prepend_hba(
        "hostssl all scram_user 127.0.0.1/32 scram-sha-256\nhostssl all plain_user 127.0.0.1/32 password",
    )
    .await;
    let port = pg.port;
    let url = |user: &str, password: &str| {
        format!("postgres://{user}:{password}@127.0.0.1:{port}/postgres?sslmode=require&channel_binding=require")
    };
    let scram = url("scram_user", "pw-scram");
    streams_with_tls(&scram, &brokers, true, &client).await;

    let stderr = fails_at_startup(&scram, Some(&url("plain_user", "pw-plain")), &brokers);
    assert_mentions(&stderr, &["channel_binding=require", "scram-sha-256"]);
    assert!(!stderr.contains("pw-plain"), "{stderr}");

    // require_auth, on a real server: SCRAM passes on both connections, a password in the clear on either
    // one is refused, with the fix.
    let url = |user: &str, password: &str, require_auth: &str| {
        format!("postgres://{user}:{password}@127.0.0.1:{port}/postgres?sslmode=require&require_auth={require_auth}")
    };
    streams_with_tls(
        &url("scram_user", "pw-scram", "scram-sha-256"),
        &brokers,
        true,
        &client,
    )
    .await;
    streams_with_tls(
        &url("plain_user", "pw-plain", "!md5"),
        &brokers,
        true,
        &client,
    )
    .await;
    let plain = url("plain_user", "pw-plain", "scram-sha-256");
    for (database_url, replication_url) in
        [(plain.clone(), None), (scram.clone(), Some(plain.as_str()))]
    {
        let stderr = fails_at_startup(&database_url, replication_url, &brokers);
        assert_mentions(
            &stderr,
            &["require_auth=scram-sha-256", "in the clear", "pg_hba.conf"],
        );
        assert!(!stderr.contains("pw-plain"), "{stderr}");
    }
    let stderr = fails_at_startup(
        &url("scram_user", "pw-scram", "scram-sha-256")
            .replace("sslmode=require", "sslmode=prefer"),
        None,
        &brokers,
    );
    assert_mentions(
        &stderr,
        &["require_auth", "sslmode=prefer", "sslmode=verify-full"],
    );
}

/// libpq's answer to the same settings, the oracle of the TLS tests: whether `psql` connects.
fn psql_connects(url: &str, env: &[(&str, &str)]) -> bool {
    std::process::Command::new(format!("{PG_CLIENT_BIN}/psql"))
        .args([url, "-Atc", "SELECT 1"])
        .envs(env.iter().copied())
        .output()
        .expect("psql")
        .status
        .success()
}

/// `verify-ca` and `require` with `sslrootcert` trust only that file's CAs, as libpq does, never the CAs the
/// machine trusts besides (review H1: a certificate of any CA in the system's store passed). Here the CA that
/// signed the server's certificate stands in the process's default store (`SSL_CERT_FILE`), and the URL
/// names another: libpq refuses, so must outboxd. `sslrootcert=system` asks for the store, with verify-full.
#[tokio::test(flavor = "multi_thread")]
async fn only_the_named_root_certificates_are_trusted() {
    let (pg, broker) = migrated_stack();
    let client = pg.client().await;
    let brokers = broker.addr();
    let certs = TestCertificates::make(&scratch_dir("certs"));
    pg.enable_tls(&certs).await;
    let port = pg.port;
    let ca = certs.ca.display().to_string();
    let other_ca = certs.other_ca.display().to_string();
    let system_trusts_the_server = [("SSL_CERT_FILE", ca.as_str())];
    for mode in ["verify-ca", "verify-full", "require"] {
        let url = format!(
            "postgres://postgres@localhost:{port}/postgres?sslmode={mode}&sslrootcert={other_ca}"
        );
        assert!(
            !psql_connects(&url, &system_trusts_the_server),
            "libpq refuses sslmode={mode} with another CA named"
        );
        let stderr = fails_at_startup_with_env(&url, None, &brokers, &system_trusts_the_server);
        assert_mentions(&stderr, &["failed verification", "sslrootcert"]);
    }
    let system = format!(
        "postgres://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert=system"
    );
    let mut outboxd =
        Outboxd::spawn_with_env(&run_args(&system, &brokers), &system_trusts_the_server);
    let backends = outboxd_backends(&client).await;
    assert!(backends.iter().all(|(_, ssl)| *ssl), "{backends:?}");
    outboxd.kill();
    let weak_system = format!(
        "postgres://postgres@localhost:{port}/postgres?sslmode=verify-ca&sslrootcert=system"
    );
    let stderr = fails_at_startup_with_env(&weak_system, None, &brokers, &system_trusts_the_server);
    assert_mentions(&stderr, &["sslrootcert=system", "sslmode=verify-full"]);
}

/// What a fake server on the replication URL does once outboxd's TLS handshake is through.
#[derive(Debug, Clone, Copy)]
enum Forgery {
    /// Offers SCRAM-SHA-256-PLUS, takes the client-first message, lets the connection in (review H2).
    OkBeforeScramEnds,
    /// Runs SCRAM with a made-up server-first message and a server signature it cannot have.
    WrongSignature,
    /// Asks for the password in the clear.
    Cleartext,
    /// Asks for the password's MD5 hash.
    Md5,
    /// Lets the connection in without authentication.
    NoAuthentication,
    /// Announces an authentication message of 1 GiB (review L8).
    HugeMessage,
}

/// A server that speaks PostgreSQL's protocol up to `forgery`, with the test certificate, on a port of its
/// own, to every connection outboxd opens (the start-up check and the readiness probe may both connect).
struct ForgingServer {
    port: u16,
    accepting: tokio::task::JoinHandle<()>,
    connections: tokio::sync::mpsc::UnboundedReceiver<tokio::task::JoinHandle<Vec<u8>>>,
}

impl ForgingServer {
    /// Once outboxd has exited: the type bytes of every message it sent after its startup messages, over
    /// all its connections. Panics if it never connected.
    async fn sent(mut self) -> Vec<u8> {
        self.accepting.abort();
        let mut sent = Vec::new();
        let mut connections = 0;
        while let Some(connection) = self.connections.recv().await {
            connections += 1;
            let tags = tokio::time::timeout(Duration::from_secs(60), connection)
                .await
                .expect("a forged connection outlived outboxd")
                .unwrap();
            sent.extend(tags);
        }
        assert!(
            connections > 0,
            "outboxd never connected to the forging server"
        );
        sent
    }
}

async fn forging_server(certs: &TestCertificates, forgery: Forgery) -> ForgingServer {
    use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod};

    let mut acceptor = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).unwrap();
    acceptor
        .set_certificate_chain_file(&certs.server_cert)
        .unwrap();
    acceptor
        .set_private_key_file(&certs.server_key, SslFiletype::PEM)
        .unwrap();
    let acceptor = acceptor.build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (connected, connections) = tokio::sync::mpsc::unbounded_channel();
    let accepting = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let connection = tokio::spawn(forge(acceptor.clone(), socket, forgery));
            if connected.send(connection).is_err() {
                return;
            }
        }
    });
    ForgingServer {
        port,
        accepting,
        connections,
    }
}

/// One connection of [`forging_server`]: returns the type bytes of what outboxd sent.
async fn forge(
    acceptor: openssl::ssl::SslAcceptor,
    mut socket: tokio::net::TcpStream,
    forgery: Forgery,
) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut sent = Vec::new();
    // A connection outboxd drops before authentication (its process ended) is simply over.
    let mut request = [0u8; 8];
    if socket.read_exact(&mut request).await.is_err() || socket.write_all(b"S").await.is_err() {
        return sent;
    }
    let ssl = openssl::ssl::Ssl::new(acceptor.context()).unwrap();
    let mut tls = tokio_openssl::SslStream::new(ssl, socket).unwrap();
    if std::pin::Pin::new(&mut tls).accept().await.is_err() {
        return sent;
    }
    let mut length = [0u8; 4];
    if tls.read_exact(&mut length).await.is_err() {
        return sent;
    }
    let mut startup = vec![0u8; (u32::from_be_bytes(length) as usize).saturating_sub(4)];
    if tls.read_exact(&mut startup).await.is_err() {
        return sent;
    }
    let message = |tag: u8, body: &[u8]| {
        let mut out = vec![tag];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    };
    let auth = |code: u32, rest: &[u8]| {
        let mut body = code.to_be_bytes().to_vec();
        body.extend_from_slice(rest);
        message(b'R', &body)
    };
    let first = match forgery {
        Forgery::Cleartext => auth(3, b""),
        Forgery::Md5 => auth(5, b"salt"),
        Forgery::NoAuthentication => [auth(0, b""), message(b'Z', b"I")].concat(),
        Forgery::HugeMessage => {
            let mut header = vec![b'R'];
            header.extend_from_slice(&(1u32 << 30).to_be_bytes());
            header
        }
        Forgery::OkBeforeScramEnds | Forgery::WrongSignature => {
            auth(10, b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0")
        }
    };
    if tls.write_all(&first).await.is_err() {
        return sent;
    }
    // What outboxd sends from now on: its type byte is recorded, and the forgery goes on.
    loop {
        let mut tag = [0u8; 1];
        if tls.read_exact(&mut tag).await.is_err() {
            return sent;
        }
        let mut length = [0u8; 4];
        if tls.read_exact(&mut length).await.is_err() {
            return sent;
        }
        let mut body = vec![0u8; (u32::from_be_bytes(length) as usize).saturating_sub(4)];
        if tls.read_exact(&mut body).await.is_err() {
            return sent;
        }
        sent.push(tag[0]);
        let answer = match (forgery, sent.len()) {
            (Forgery::OkBeforeScramEnds, 1) => [auth(0, b""), message(b'Z', b"I")].concat(),
            (Forgery::WrongSignature, 1) => {
                // The client-first message: "<mechanism>\0<len><gs2 header>n=,r=<nonce>".
                let text = String::from_utf8_lossy(&body).into_owned();
                let nonce = text.split("r=").nth(1).unwrap_or_default().to_string();
                let server_first = format!("r={nonce}forged,s=c2FsdHNhbHQ=,i=4096");
                auth(11, server_first.as_bytes())
            }
            (Forgery::WrongSignature, 2) => [
                auth(12, b"v=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="),
                auth(0, b""),
                message(b'Z', b"I"),
            ]
            .concat(),
            // A password in the clear is recorded ('p'); anything after the forgery ends is too.
            _ => Vec::new(),
        };
        if !answer.is_empty() && tls.write_all(&answer).await.is_err() {
            return sent;
        }
    }
}

/// `require_auth=scram-sha-256` (libpq 16's setting, which tokio-postgres lacks) holds on both connections: a
/// server, or a man in the middle, asking for the password in the clear or as MD5, or letting outboxd in
/// without authentication, is refused before outboxd answers: no password, no query, no replication command.
#[tokio::test(flavor = "multi_thread")]
async fn require_auth_refuses_every_other_method_on_both_connections() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let certs = TestCertificates::make(&scratch_dir("certs"));
    for (forgery, says) in [
        (Forgery::Cleartext, "the password in the clear"),
        (Forgery::Md5, "MD5"),
        (Forgery::NoAuthentication, "without authentication"),
    ] {
        for replication_side in [false, true] {
            let server = forging_server(&certs, forgery).await;
            let forged = format!(
                "postgres://outboxd:secret-pw@127.0.0.1:{}/postgres?sslmode=require&require_auth=scram-sha-256",
                server.port
            );
            let (database_url, replication_url) = if replication_side {
                (pg.url(), Some(forged))
            } else {
                (forged, None)
            };
            let stderr = tokio::task::spawn_blocking({
                let brokers = brokers.clone();
                move || fails_at_startup(&database_url, replication_url.as_deref(), &brokers)
            })
            .await
            .unwrap();
            let sent = server.sent().await;
            assert!(
                !sent.iter().any(|tag| matches!(tag, b'p' | b'Q' | b'P')),
                "{forgery:?} (replication side: {replication_side}): outboxd answered ({sent:?}): {stderr}"
            );
            assert_mentions(&stderr, &["require_auth=scram-sha-256", says]);
            assert!(!stderr.contains("secret-pw"), "{stderr}");
        }
    }
}

/// A man in the middle on the replication connection cannot get outboxd past authentication: it never
/// sends a replication command (from there a forged stream would be published to Kafka) nor a password in
/// the clear, whatever the server skips or forges (review H2: AuthenticationOk before SCRAM's final step
/// was taken under `channel_binding=require`; L8: a 1 GiB message was allocated before it arrived).
#[tokio::test(flavor = "multi_thread")]
async fn a_forging_server_on_the_replication_url_gets_nothing_past_authentication() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let certs = TestCertificates::make(&scratch_dir("certs"));
    let database_url = pg.url();
    for (forgery, says) in [
        (Forgery::OkBeforeScramEnds, "SCRAM"),
        (Forgery::WrongSignature, "SCRAM"),
        (Forgery::Cleartext, "channel_binding=require"),
        (Forgery::HugeMessage, "more than the"),
    ] {
        let server = forging_server(&certs, forgery).await;
        let port = server.port;
        let replication_url = format!(
            "postgres://outboxd:secret-pw@127.0.0.1:{port}/postgres?sslmode=require&channel_binding=require"
        );
        let stderr = tokio::task::spawn_blocking({
            let (database_url, brokers) = (database_url.clone(), brokers.clone());
            move || fails_at_startup(&database_url, Some(&replication_url), &brokers)
        })
        .await
        .unwrap();
        let sent = server.sent().await;
        assert!(
            !sent.contains(&b'Q'),
            "{forgery:?}: outboxd sent a replication command after a forged authentication: {stderr}"
        );
        if matches!(forgery, Forgery::Cleartext) {
            assert!(
                !sent.contains(&b'p'),
                "{forgery:?}: the password went in the clear"
            );
        }
        assert_mentions(&stderr, &[says]);
        assert!(!stderr.contains("secret-pw"), "{stderr}");
    }
}

/// The same forgeries on `--database-url` (ordinary SQL, tokio-postgres's authentication): outboxd never
/// sends a query (from there forged rows could be claimed and published) nor a password in the clear.
#[tokio::test(flavor = "multi_thread")]
async fn a_forging_server_on_the_database_url_gets_nothing_past_authentication() {
    let broker = Broker::start();
    let brokers = broker.addr();
    let certs = TestCertificates::make(&scratch_dir("certs"));
    for forgery in [
        Forgery::OkBeforeScramEnds,
        Forgery::WrongSignature,
        Forgery::Cleartext,
        Forgery::HugeMessage,
    ] {
        let server = forging_server(&certs, forgery).await;
        let port = server.port;
        let database_url = format!(
            "postgres://outboxd:secret-pw@127.0.0.1:{port}/postgres?sslmode=require&channel_binding=require"
        );
        let stderr = tokio::task::spawn_blocking({
            let brokers = brokers.clone();
            move || {
                let mut args = run_args(&database_url, &brokers);
                args.extend(["--startup-timeout", "5s"]);
                stderr_of(&run_outboxd(&args))
            }
        })
        .await
        .unwrap();
        let sent = server.sent().await;
        eprintln!(
            "{forgery:?}: outboxd sent {sent:?}; {}",
            stderr.lines().last().unwrap_or_default()
        );
        assert!(
            !sent.iter().any(|tag| matches!(tag, b'Q' | b'P')),
            "{forgery:?}: outboxd sent a query after a forged authentication ({sent:?}): {stderr}"
        );
        if matches!(forgery, Forgery::Cleartext) {
            assert!(
                !sent.contains(&b'p'),
                "{forgery:?}: the password went in the clear"
            );
        }
        assert!(stderr.contains("error:"), "{forgery:?}: {stderr}");
        assert!(!stderr.contains("secret-pw"), "{stderr}");
    }
}
