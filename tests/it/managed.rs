//! What managed PostgreSQL services take away or add, on a cluster set up the way they are: passwords that
//! expire (IAM / Entra tokens, `--database-password-command`) and client certificates.

use std::time::Duration;

use crate::support::*;

/// A password that changes while outboxd runs (an IAM token every 15 minutes): `--database-password-command`
/// is run again at every connection, so after the role's password changed and every session was cut,
/// outboxd reconnects with the new one and publishes everything. The password never reaches its log.
#[tokio::test(flavor = "multi_thread")]
async fn a_password_command_gives_each_connection_a_fresh_password() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    readme_role(&pg, "token-0001", "outbox_event", "").await;
    let token = pg.dir.join("token");
    std::fs::write(&token, "token-0001\n").unwrap();
    let url = pg.url_for("outboxd_app", None);
    let command = format!("cat {}", token.display());
    let mut args = run_args(&url, &brokers);
    args.extend(["--database-password-command", &command]);
    let outboxd = Outboxd::spawn(&args);
    let mut admin = pg.client().await;
    wait_slot_active(&admin, "outboxd").await;
    let (mut committed, _) = insert_events(&mut admin, 0, 20, 5, 10, None).await;
    wait_all_published(&admin, Duration::from_secs(60)).await;

    // The token rotates: the old password stops working, every session of the role is cut.
    std::fs::write(&token, "token-0002\n").unwrap();
    admin
        .batch_execute(
            "ALTER ROLE outboxd_app PASSWORD 'token-0002';
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'outboxd_app'",
        )
        .await
        .unwrap();
    let (more, _) = insert_events(&mut admin, 20, 20, 5, 10, None).await;
    committed.extend(more);
    wait_all_published(&admin, Duration::from_secs(120)).await;
    wait_slot_active(&admin, "outboxd").await;
    let sessions: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = 'outboxd_app'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(sessions > 0, "outboxd reconnected with the new password");
    verify_delivery(&brokers, &committed, &[], 120, "password rotated");
    let log = outboxd.log_text();
    assert!(
        !log.contains("token-0001") && !log.contains("token-0002"),
        "no password in the log"
    );
}

/// A command that fails is retried, and says which program failed and why, never what it printed.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_password_command_is_named_in_the_error() {
    let pg = Postgres::start();
    let url = pg.url_for("postgres", None);
    let output = run_outboxd(&[
        "status",
        "--database-url",
        &url,
        "--database-password-command",
        "/nonexistent/token-helper --profile prod-secret",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(3), "{stdout}");
    assert!(
        stdout.contains("cannot run /nonexistent/token-helper") && !stdout.contains("prod-secret"),
        "{stdout}"
    );
    let with_password = run_outboxd(&[
        "status",
        "--database-url",
        &pg.url_for("postgres", Some("pw")),
        "--database-password-command",
        "cat /dev/null",
    ]);
    let stderr = String::from_utf8_lossy(&with_password.stderr);
    assert!(
        stderr.contains("remove the password from the URL"),
        "{stderr}"
    );
}

/// A server that asks for a client certificate as well as the password (`clientcert=verify-full` in
/// pg_hba, as managed services offer): with `sslcert`/`sslkey` in the URL both connections (SQL and
/// replication) get in and every event is published; without them, or with a key others may read, outboxd
/// says what is wrong.
#[tokio::test(flavor = "multi_thread")]
async fn client_certificates_open_both_connections() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let dir = scratch_dir("certs");
    let certs = TestCertificates::make(&dir);
    pg.enable_tls(&certs).await;
    let (cert, key) = certs.client("outboxd_app");
    let ca_copy = pg.dir.join("tls/ca.crt");
    std::fs::copy(&certs.ca, &ca_copy).unwrap();
    let _ = std::process::Command::new("chown")
        .arg("postgres:")
        .arg(&ca_copy)
        .status();
    let admin = pg.client().await;
    for statement in [
        format!("ALTER SYSTEM SET ssl_ca_file = '{}'", ca_copy.display()),
        "SELECT pg_reload_conf()".to_string(),
    ] {
        admin.batch_execute(&statement).await.unwrap();
    }
    readme_role(&pg, "pw-cert", "outbox_event", "").await;
    pg.prepend_hba("hostssl all outboxd_app 127.0.0.1/32 scram-sha-256 clientcert=verify-full\nhost all outboxd_app 127.0.0.1/32 reject")
        .await;
    let base = format!(
        "postgres://outboxd_app:pw-cert@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        pg.port,
        certs.ca.display()
    );

    // Without a certificate the server refuses, and the error says so.
    let refused = run_outboxd(&["status", "--database-url", &base]);
    let stdout = String::from_utf8_lossy(&refused.stdout);
    assert_eq!(refused.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("certificate"), "{stdout}");

    // A key others may read is refused as libpq refuses it.
    let url = format!("{base}&sslcert={}&sslkey={}", cert.display(), key.display());
    let status = std::process::Command::new("chmod")
        .arg("644")
        .arg(&key)
        .status()
        .unwrap();
    assert!(status.success());
    let loose = run_outboxd(&["status", "--database-url", &url]);
    let stderr = String::from_utf8_lossy(&loose.stderr);
    assert!(
        stderr.contains("others may read it") && stderr.contains("chmod"),
        "{stderr}"
    );
    let status = std::process::Command::new("chmod")
        .arg("600")
        .arg(&key)
        .status()
        .unwrap();
    assert!(status.success());

    let mut admin = pg.client().await;
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&admin, "outboxd").await;
    let (committed, _) = insert_events(&mut admin, 0, 20, 5, 10, None).await;
    wait_all_published(&admin, Duration::from_secs(60)).await;
    verify_delivery(&brokers, &committed, &[], 60, "client certificates");
    let with_certificates: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE a.usename = 'outboxd_app' AND s.client_dn = '/CN=outboxd_app'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let walsenders: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_replication r USING (pid)
             WHERE s.client_dn = '/CN=outboxd_app'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        with_certificates >= 2,
        "SQL sessions with the certificate: {with_certificates}"
    );
    assert_eq!(walsenders, 1, "the replication connection presented it too");
}

/// A cluster set up as a managed service's: nobody outboxd uses is a superuser. The application's role owns
/// the table and runs `outboxd migrate`; `outboxd run` uses README's role (`LOGIN REPLICATION`, `SELECT,
/// UPDATE` on the table), which owns nothing. Every event is published, rows older than the slot included.
#[tokio::test(flavor = "multi_thread")]
async fn the_owner_migrates_and_a_role_with_only_readmes_grants_runs() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let brokers = broker.addr();
    let admin = pg.client().await;
    admin
        .batch_execute(
            "CREATE ROLE app_owner LOGIN PASSWORD 'owner-pw';
             GRANT CREATE ON SCHEMA public TO app_owner;
             GRANT CREATE ON DATABASE postgres TO app_owner;",
        )
        .await
        .unwrap();
    pg.prepend_hba("host all app_owner 127.0.0.1/32 scram-sha-256")
        .await;
    let owner_url = pg.url_for("app_owner", Some("owner-pw"));
    let migrated = run_outboxd(&["migrate", "--database-url", &owner_url]);
    assert!(migrated.status.success(), "{}", stderr_of(&migrated));
    let owner: String = admin
        .query_one(
            "SELECT tableowner::text FROM pg_tables WHERE tablename = 'outbox_event'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(owner, "app_owner");
    // The application writes as the owner, before and after outboxd's slot exists.
    let mut app = {
        let (client, connection) = tokio_postgres::connect(&owner_url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
    };
    let (mut committed, _) = insert_events(&mut app, 0, 10, 5, 5, None).await;
    let url = readme_role(&pg, "run-pw", "outbox_event", "").await;
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&admin, "outboxd").await;
    let (more, _) = insert_events(&mut app, 10, 20, 5, 5, None).await;
    committed.extend(more);
    wait_all_published(&admin, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 120, "managed roles");
    let superusers: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_roles WHERE rolname IN ('app_owner', 'outboxd_app') AND rolsuper",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(superusers, 0);
}
