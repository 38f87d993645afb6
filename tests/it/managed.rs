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
