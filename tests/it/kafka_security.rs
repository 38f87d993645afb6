//! Kafka security against a real Apache Kafka node: SASL_SSL with SCRAM-SHA-512 and a certificate from a CA
//! made by the test harness (`kafka.sh start-secure`), ACLs enforced (StandardAuthorizer, nothing allowed
//! without one). outboxd publishes as a user that may only write and create its topic; a wrong password and a
//! CA that did not sign the broker's certificate stop it at start-up with the reason and the fix.

use std::process::Output;

use crate::support::*;

/// `outboxd run` against `broker` as its super user with `password`, trusting `ca`, under a start-up timeout
/// (10 minutes) long enough that only a definite failure ends it before `run_outboxd`'s deadline (120 s).
fn run_failing_at_startup(
    pg: &Postgres,
    broker: &SecureBroker,
    password: &str,
    ca: &std::path::Path,
) -> Output {
    let (url, brokers) = (pg.url(), broker.addr());
    let options = SecureBroker::kafka_options(SECURE_ADMIN, password, ca);
    let mut args = run_args(&url, &brokers);
    args.extend(["--startup-timeout", "10m"]);
    args.extend(options.iter().map(String::as_str));
    run_outboxd(&args)
}

/// Everything outboxd printed, stdout and stderr.
fn all_output(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_mentions(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "expected {needle:?} in:\n{text}");
    }
}

/// The line a person acts on: `error: ...`, printed last.
fn error_line(output: &Output) -> String {
    let stderr = stderr_of(output);
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"))
        .to_string();
    println!("{line}");
    line
}

#[tokio::test(flavor = "multi_thread")]
async fn publishes_over_sasl_ssl_as_a_user_allowed_only_to_write_and_create_its_topic() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = SecureBroker::start();
    let password = "outboxd-pw-7f3a";
    broker.add_user("outboxd", password);
    broker.allow("outboxd", &["WRITE", "CREATE"], "TOPIC", TOPIC);

    let (url, brokers) = (pg.url(), broker.addr());
    let options = SecureBroker::kafka_options("outboxd", password, &broker.ca);
    let mut args = run_args(&url, &brokers);
    args.extend(options.iter().map(String::as_str));
    let outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;

    let (committed, rolled_back) = insert_events(&mut client, 0, 30, 10, 7, Some(9)).await;
    verify_fault_free_delivery(
        &broker.plaintext_addr(),
        &committed,
        &rolled_back,
        120,
        "over SASL_SSL",
    );
    wait_all_published(&client, std::time::Duration::from_secs(60)).await;
    let log = outboxd.log_text();
    assert!(
        !log.contains(password),
        "the password appears in the log:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_password_stops_outboxd_at_start_up_with_the_reason_and_the_fix() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = SecureBroker::start();
    let wrong = "not-the-password-91c2";

    let output = run_failing_at_startup(&pg, &broker, wrong, &broker.ca);
    let line = error_line(&output);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_mentions(
        &line,
        &[
            "refused outboxd's credentials",
            "SASL authentication failed",
            "invalid credentials",
            &broker.addr(),
            "fix: check sasl.username / sasl.password",
        ],
    );
    let everything = all_output(&output);
    assert!(
        !everything.contains(wrong),
        "the password appears in the output:\n{everything}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_untrusted_broker_certificate_stops_outboxd_at_start_up_with_the_reason_and_the_fix() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = SecureBroker::start();
    // A CA of its own, which did not sign the broker's certificate.
    let other_ca = TestCertificates::make(&scratch_dir("certs")).other_ca;

    let output = run_failing_at_startup(&pg, &broker, SECURE_ADMIN_PASSWORD, &other_ca);
    let line = error_line(&output);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_mentions(
        &line,
        &[
            "TLS certificate is not trusted",
            "certificate verify failed",
            &broker.addr(),
            "fix: set --kafka-option ssl.ca.location to the CA certificate",
        ],
    );
    let everything = all_output(&output);
    assert!(
        !everything.contains(SECURE_ADMIN_PASSWORD),
        "the password appears in the output:\n{everything}"
    );

    // A CA file that cannot be read is a configuration error naming the property.
    let output = run_failing_at_startup(
        &pg,
        &broker,
        SECURE_ADMIN_PASSWORD,
        std::path::Path::new("/nonexistent/kafka-ca.pem"),
    );
    let line = error_line(&output);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert_mentions(&line, &["ssl.ca.location", "fix:"]);
}
