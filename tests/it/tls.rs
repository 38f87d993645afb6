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
    let mut args = run_args(database_url, brokers);
    args.extend(["--startup-timeout", "30s"]);
    if let Some(url) = replication_url {
        args.extend(["--replication-url", url]);
    }
    let output = run_outboxd(&args);
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
        &["failed verification", "sslmode=verify-full", "verify-ca"],
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
}
