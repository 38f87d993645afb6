//! Test harness: throwaway PostgreSQL clusters and brokers (Apache Kafka; tansu with OUTBOXD_TEST_BROKER=tansu) started through the same scripts README and
//! CI use (`tests/support/*.sh`), the outboxd binary as a child process, and a Kafka consumer that reads
//! everything back. Everything started here is stopped on drop, by PID.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

pub mod in_process;
mod ports;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn support_script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(name)
}

/// A port nothing listens on, for a server a test starts (see `ports.rs` for the range and why).
pub fn free_port() -> u16 {
    ports::free_port().expect("no port for a test server")
}

pub fn scratch_dir(kind: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = std::env::temp_dir().join(format!("outboxd-test-{}-{kind}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot create scratch dir");
    dir
}

fn run_script(script: &str, args: &[&str], envs: &[(&str, &str)]) {
    let mut command = Command::new("bash");
    command.arg(support_script(script)).args(args);
    for (k, v) in envs {
        command.env(k, v);
    }
    let output = command.output().expect("cannot run support script");
    assert!(
        output.status.success(),
        "{script} {args:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Polls `check` until it returns `Some`, panicking with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Async flavour of [`wait_for`].
pub async fn wait_for_async<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub struct Postgres {
    pub dir: PathBuf,
    pub port: u16,
    /// When the cluster started: its test's duration goes to OUTBOXD_TEST_TIMES (tests/run.sh).
    started: Instant,
}

impl Postgres {
    pub fn start() -> Self {
        Self::start_with_wal_level("logical")
    }

    pub fn start_with_wal_level(level: &str) -> Self {
        let dir = scratch_dir("pg");
        let port = free_port();
        run_script(
            "pg.sh",
            &["start", dir.to_str().unwrap(), &port.to_string()],
            &[("PG_WAL_LEVEL", level)],
        );
        Postgres {
            dir,
            port,
            started: Instant::now(),
        }
    }

    pub fn url(&self) -> String {
        self.url_for("postgres", None)
    }

    pub fn url_for(&self, user: &str, password: Option<&str>) -> String {
        match password {
            Some(pw) => format!("postgres://{user}:{pw}@127.0.0.1:{}/postgres", self.port),
            None => format!("postgres://{user}@127.0.0.1:{}/postgres", self.port),
        }
    }

    /// The superuser's URL through another port (a test's proxy in front of this server).
    pub fn url_via(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }

    /// Stops the server (fast); `start_again` brings the same cluster back on the same port.
    pub fn stop(&self) {
        run_script("pg.sh", &["stop", self.dir.to_str().unwrap()], &[]);
    }

    pub fn start_again(&self) {
        run_script(
            "pg.sh",
            &["start", self.dir.to_str().unwrap(), &self.port.to_string()],
            &[],
        );
    }

    pub fn restart(&self, mode: &str) {
        run_script("pg.sh", &["restart", self.dir.to_str().unwrap(), mode], &[]);
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        self.client_at(&self.url()).await
    }

    /// A connection as `user` (trust authentication, as the cluster is set up).
    pub async fn client_as(&self, user: &str) -> tokio_postgres::Client {
        self.client_at(&self.url_for(user, None)).await
    }

    async fn client_at(&self, url: &str) -> tokio_postgres::Client {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("cannot connect to test cluster");
        tokio::spawn(connection);
        client
    }

    /// Removes a pg_hba.conf line added by [`Postgres::prepend_hba`] and reloads.
    pub async fn remove_hba(&self, line: &str) {
        let path = self.dir.join("data/pg_hba.conf");
        let current = std::fs::read_to_string(&path).unwrap();
        let kept: Vec<&str> = current.lines().filter(|l| *l != line).collect();
        std::fs::write(&path, kept.join("\n") + "\n").unwrap();
        self.client()
            .await
            .execute("SELECT pg_reload_conf()", &[])
            .await
            .unwrap();
    }

    /// Appends a pg_hba.conf line before the default trust lines and reloads.
    pub async fn prepend_hba(&self, line: &str) {
        let path = self.dir.join("data/pg_hba.conf");
        let current = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{line}\n{current}")).unwrap();
        self.client()
            .await
            .execute("SELECT pg_reload_conf()", &[])
            .await
            .unwrap();
    }
}

/// A test certificate authority and a server certificate for `localhost` (DNS name only, so connecting
/// to 127.0.0.1 fails host-name verification), plus an unrelated CA, made with the `openssl` CLI.
pub struct TestCertificates {
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    dir: PathBuf,
}

/// Runs the `openssl` CLI in `dir`, failing the test with its error.
fn openssl_in(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("cannot run openssl (install the openssl package)");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

impl TestCertificates {
    /// A client certificate for `user` (its CN) signed by the test CA, with a key only its owner may read;
    /// returns (certificate, key).
    pub fn client(&self, user: &str) -> (PathBuf, PathBuf) {
        let subject = format!("/CN={user}");
        openssl_in(
            &self.dir,
            &[
                "req",
                "-subj",
                &subject,
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "client.key",
                "-out",
                "client.csr",
            ],
        );
        openssl_in(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                "client.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                "client.crt",
            ],
        );
        let key = self.dir.join("client.key");
        let status = Command::new("chmod").arg("600").arg(&key).status().unwrap();
        assert!(status.success());
        (self.dir.join("client.crt"), key)
    }

    pub fn make(dir: &Path) -> Self {
        let openssl = |args: &[&str]| openssl_in(dir, args);
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (name, subject) in [
            ("ca", "/CN=outboxd test CA"),
            ("other-ca", "/CN=someone else"),
        ] {
            let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
            let mut args = vec![
                "req", "-x509", "-days", "2", "-subj", subject, "-keyout", &key, "-out", &crt,
            ];
            args.extend_from_slice(&ec);
            openssl(&args);
        }
        let mut args = vec![
            "req",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ];
        args.extend_from_slice(&ec);
        openssl(&args);
        std::fs::write(dir.join("san.ext"), "subjectAltName=DNS:localhost\n").unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.crt",
        ]);
        TestCertificates {
            ca: dir.join("ca.crt"),
            other_ca: dir.join("other-ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            dir: dir.to_path_buf(),
        }
    }
}

impl Postgres {
    /// Turns TLS on (ssl = on with the given certificate) and reloads; plain connections still work.
    pub async fn enable_tls(&self, certs: &TestCertificates) {
        let dir = self.dir.join("tls");
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
        std::fs::copy(&certs.server_cert, &cert).unwrap();
        std::fs::copy(&certs.server_key, &key).unwrap();
        // PostgreSQL insists on a private key only its owner can read.
        let status = Command::new("chmod").arg("600").arg(&key).status().unwrap();
        assert!(status.success());
        if Command::new("id").arg("-u").output().unwrap().stdout == b"0\n" {
            let status = Command::new("chown")
                .arg("-R")
                .arg("postgres:")
                .arg(&dir)
                .status()
                .unwrap();
            assert!(status.success());
        }
        let client = self.client().await;
        for (setting, value) in [("ssl_cert_file", &cert), ("ssl_key_file", &key)] {
            client
                .batch_execute(&format!(
                    "ALTER SYSTEM SET {setting} = '{}'",
                    value.display()
                ))
                .await
                .unwrap();
        }
        client
            .batch_execute("ALTER SYSTEM SET ssl = on")
            .await
            .unwrap();
        client
            .execute("SELECT pg_reload_conf()", &[])
            .await
            .unwrap();
        wait_for_async("ssl to be on", Duration::from_secs(10), || async {
            let on: String = client.query_one("SHOW ssl", &[]).await.ok()?.get(0);
            (on == "on").then_some(())
        })
        .await;
    }
}

/// Copies of a cluster, for failover and restore tests. None is started; `start_again` starts one.
impl Postgres {
    /// A `pg_basebackup` of this running server, listening on a port of its own. With `standby`, it
    /// streams from this server once started (a physical standby, `pg_ctl promote` to fail over).
    pub fn basebackup(&self, standby: bool) -> Postgres {
        let dir = scratch_dir("pg-copy");
        let port = free_port();
        let (dir_arg, port_arg, source) = (
            dir.to_str().unwrap().to_string(),
            port.to_string(),
            self.port.to_string(),
        );
        let mut args = vec!["basebackup", &dir_arg, &port_arg, &source];
        if standby {
            args.push("standby");
        }
        run_script("pg.sh", &args, &[]);
        Postgres {
            dir,
            port,
            started: Instant::now(),
        }
    }

    /// A file-level copy of this (stopped) cluster: a cold base backup, replication slots included.
    pub fn cold_copy(&self) -> Postgres {
        let dir = scratch_dir("pg-copy");
        let port = free_port();
        let status = Command::new("cp")
            .arg("-a")
            .arg(self.dir.join("data"))
            .arg(dir.join("data"))
            .status()
            .unwrap();
        assert!(status.success(), "cannot copy the data directory");
        let conf = dir.join("data/postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str(&format!(
            "port = {port}\nunix_socket_directories = '{}'\n",
            dir.display()
        ));
        std::fs::write(&conf, text).unwrap();
        let _ = Command::new("chown")
            .args(["-R", "postgres:"])
            .arg(&dir)
            .status();
        Postgres {
            dir,
            port,
            started: Instant::now(),
        }
    }

    /// Promotes a standby and waits until it accepts writes.
    pub fn promote(&self) {
        run_script("pg.sh", &["promote", self.dir.to_str().unwrap()], &[]);
    }

    /// Stops the server without a shutdown checkpoint (a crash, as far as the server can tell).
    pub fn stop_immediate(&self) {
        run_script(
            "pg.sh",
            &["stop", self.dir.to_str().unwrap(), "immediate"],
            &[],
        );
    }

    pub fn url_of_database(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }
}

/// An application that keeps inserting outbox transactions through one URL, the way an order service
/// does: every failure (a server gone, read-only, or missing the database) is retried on a new connection,
/// so it writes through a failover or switchover. Transaction numbers only grow, so the events' `seq`
/// follows commit order.
pub struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    committed: std::sync::Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Writer {
    pub fn start(url: String, per_txn: usize, aggregates: usize) -> Self {
        Self::start_at(url, 0, per_txn, aggregates)
    }

    /// A writer whose transaction numbers start after `first_txn` (to follow another writer's).
    pub fn start_at(url: String, first_txn: usize, per_txn: usize, aggregates: usize) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let committed = std::sync::Arc::new(AtomicUsize::new(0));
        let (stopping, count) = (stop.clone(), committed.clone());
        let task = tokio::spawn(async move {
            let mut t = first_txn;
            while !stopping.load(Ordering::SeqCst) {
                let connected = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio_postgres::connect(&url, tokio_postgres::NoTls),
                )
                .await;
                let Ok(Ok((mut client, connection))) = connected else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                tokio::spawn(connection);
                while !stopping.load(Ordering::SeqCst) {
                    t += 1;
                    let Ok(tx) = client.transaction().await else {
                        break;
                    };
                    if try_insert_txn_events(&tx, t, per_txn, aggregates)
                        .await
                        .is_err()
                        || tx.commit().await.is_err()
                    {
                        break;
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Writer {
            stop,
            committed,
            task,
        }
    }

    /// Transactions committed so far (whose COMMIT was answered).
    pub fn committed(&self) -> usize {
        self.committed.load(Ordering::SeqCst)
    }

    /// Waits until `more` transactions beyond the current count are committed.
    pub async fn wait_more(&self, more: usize, what: &str) {
        let target = self.committed() + more;
        wait_for_async(what, Duration::from_secs(120), || async {
            (self.committed() >= target).then_some(())
        })
        .await;
    }

    pub async fn stop(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        let committed = self.committed.clone();
        self.task.await.unwrap();
        committed.load(Ordering::SeqCst)
    }
}

/// The events in the outbox table of the server behind `client`, in commit order: by `order`, an int8
/// expression that also becomes their `seq` (the writers' `(payload->>'seq')::int8`, or `position`).
pub async fn events_in_table(client: &tokio_postgres::Client, order: &str) -> Vec<Inserted> {
    client
        .query(
            &format!(
                "SELECT event_id, aggregate_id, {order} AS seq FROM outbox_event ORDER BY seq"
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| Inserted {
            event_id: row.get(0),
            aggregate_id: row.get(1),
            seq: row.get(2),
        })
        .collect()
}

impl Drop for Postgres {
    fn drop(&mut self) {
        run_script("pg.sh", &["stop", self.dir.to_str().unwrap()], &[]);
        let _ = std::fs::remove_dir_all(&self.dir);
        record_test_time(self.started);
    }
}

/// Appends "<test>\t<seconds>" to the file OUTBOXD_TEST_TIMES names (tests/run.sh lists the slowest tests
/// from it): the time since `started`, under the name libtest gives the test's thread.
fn record_test_time(started: Instant) {
    use std::io::Write;
    let Some(path) = std::env::var_os("OUTBOXD_TEST_TIMES") else {
        return;
    };
    let name = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("{name}\t{:.0}\n", started.elapsed().as_secs_f64());
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = file.write_all(line.as_bytes());
    }
}

pub struct Broker {
    pub dir: PathBuf,
    pub port: u16,
    /// Port the broker advertises (a proxy's) and storage URL, kept for `start_again`.
    advertised: Option<u16>,
    storage: Option<String>,
}

impl Broker {
    pub fn start() -> Self {
        Self::start_with_properties(&[])
    }

    /// An Apache Kafka node with `properties` (`key=value`) added to its server.properties, e.g. a quick
    /// `log.retention.check.interval.ms` (tests/support/kafka.sh: OUTBOXD_KAFKA_PROPERTIES; tansu ignores
    /// them).
    pub fn start_with_properties(properties: &[&str]) -> Self {
        let dir = scratch_dir("broker");
        let port = free_port();
        let properties = properties.join("\n");
        let envs: Vec<(&str, &str)> = if properties.is_empty() {
            Vec::new()
        } else {
            vec![("OUTBOXD_KAFKA_PROPERTIES", properties.as_str())]
        };
        run_script(
            "broker.sh",
            &["start", dir.to_str().unwrap(), &port.to_string()],
            &envs,
        );
        Broker {
            dir,
            port,
            advertised: None,
            storage: None,
        }
    }

    /// Stops the broker process; `start_again` brings it back on the same port with the same storage.
    pub fn stop(&self) {
        run_script("broker.sh", &["stop", self.dir.to_str().unwrap()], &[]);
    }

    pub fn start_again(&self) {
        let port = self.port.to_string();
        let advertised = self.advertised.unwrap_or(self.port).to_string();
        let envs: Vec<(&str, &str)> = self
            .storage
            .as_deref()
            .map(|storage| ("TANSU_STORAGE", storage))
            .into_iter()
            .collect();
        run_script(
            "broker.sh",
            &["start", self.dir.to_str().unwrap(), &port, &advertised],
            &envs,
        );
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        run_script("broker.sh", &["stop", self.dir.to_str().unwrap()], &[]);
        if std::thread::panicking() {
            eprintln!("--- broker kept for inspection: {} ---", self.dir.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn outboxd_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    command.args(args);
    for (key, _) in std::env::vars() {
        if key.starts_with("OUTBOXD_") {
            command.env_remove(key);
        }
    }
    // Many outboxd processes run at once in tests: no metrics listener unless a test asks for one.
    command.env("OUTBOXD_METRICS_ADDR", "off");
    command.env(
        "RUST_LOG",
        "info,outboxd=trace,rdkafka=warn,tokio_postgres=warn",
    );
    command
}

/// Runs outboxd to completion (for migrate, status and start-up errors), with a safety timeout.
pub fn run_outboxd(args: &[&str]) -> Output {
    run_outboxd_with_env(args, &[])
}

/// [`run_outboxd`] from async code (a test's runtime keeps serving its other tasks meanwhile).
pub async fn run_outboxd_async(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_outboxd(&args)
    })
    .await
    .expect("the thread running outboxd panicked")
}

/// [`run_outboxd`] with extra environment.
pub fn run_outboxd_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = outboxd_command(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes while waiting: output larger than a pipe's buffer would otherwise block the child.
    let read_all = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = read_all(Box::new(child.stdout.take().unwrap()));
    let stderr = read_all(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "outboxd {args:?} did not exit; stdout: {}; stderr: {}",
                String::from_utf8_lossy(&stdout.join().unwrap()),
                String::from_utf8_lossy(&stderr.join().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

pub fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A running `outboxd run`, logging to a file; SIGKILLed on drop.
pub struct Outboxd {
    child: Child,
    pub log: PathBuf,
}

impl Outboxd {
    pub fn spawn(args: &[&str]) -> Self {
        Self::spawn_with_env(args, &[])
    }

    /// With extra environment (e.g. `RUST_LOG=warn` for long runs, where trace logging only costs CPU).
    pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let log = scratch_dir("outboxd").join("outboxd.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = outboxd_command(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("cannot start outboxd");
        Outboxd { child, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal("TERM");
        self.wait_exit()
    }

    /// Sends `signal` ("TERM", "INT", "STOP", …) without waiting.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits (up to 60 s) for the process to exit.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        wait_for("outboxd to exit", Duration::from_secs(60), || {
            self.child.try_wait().unwrap()
        })
    }

    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Waits (up to 60 s) until the log says a CDC session streams from the slot.
    pub fn wait_streaming(&self) {
        wait_for("outboxd to stream", Duration::from_secs(60), || {
            self.log_text()
                .contains("streaming from replication slot")
                .then_some(())
        });
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Outboxd {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- outboxd log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            );
        }
    }
}

#[derive(Debug, Clone)]
pub struct Record {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: Option<Vec<u8>>,
    pub headers: HashMap<String, String>,
    /// The record's CreateTime (ms since the epoch), set by the producer.
    pub timestamp: Option<i64>,
}

impl Record {
    /// A consumed message as a `Record`, its headers as text.
    pub fn of(message: &impl Message) -> Self {
        let mut headers = HashMap::new();
        if let Some(h) = message.headers() {
            for header in h.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                headers.insert(header.key.to_string(), value);
            }
        }
        Record {
            topic: message.topic().to_string(),
            partition: message.partition(),
            offset: message.offset(),
            key: message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned()),
            value: message.payload().map(|p| p.to_vec()),
            headers,
            timestamp: message.timestamp().to_millis(),
        }
    }
}

/// Reads every record of `topics` from the beginning: waits until at least `expected` arrived, then keeps
/// reading until the topics are quiet, so duplicates beyond `expected` are seen too.
pub fn consume_all(
    brokers: &str,
    topics: &[&str],
    expected: usize,
    timeout: Duration,
) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("outboxd-test-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .create()
        .expect("cannot create consumer");
    let mut assignment = TopicPartitionList::new();
    for topic in topics {
        let metadata = wait_for(&format!("metadata of topic {topic}"), timeout, || {
            consumer
                .fetch_metadata(Some(topic), Duration::from_secs(5))
                .ok()
                // Every partition with a leader: a topic created a moment ago may list some without one
                // yet, and a partition left out of the assignment is never read.
                .filter(|m| {
                    m.topics().iter().any(|t| {
                        t.error().is_none()
                            && !t.partitions().is_empty()
                            && t.partitions()
                                .iter()
                                .all(|p| p.error().is_none() && p.leader() >= 0)
                    })
                })
        });
        for t in metadata.topics() {
            for p in t.partitions() {
                assignment
                    .add_partition_offset(t.name(), p.id(), Offset::Beginning)
                    .unwrap();
            }
        }
    }
    consumer.assign(&assignment).unwrap();
    let mut records = Vec::new();
    let deadline = Instant::now() + timeout;
    let mut quiet_polls = 0;
    // Quiet is not enough on a loaded machine (a partition's fetch can lag while duplicates already make up
    // the count): also read every partition up to the end it had when reading began.
    let ends: Vec<(String, i32, i64)> = assignment
        .elements()
        .iter()
        .map(|e| {
            let (_, high) = consumer
                .fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(10))
                .unwrap_or((0, 0));
            (e.topic().to_string(), e.partition(), high)
        })
        .collect();
    let mut read_up_to: HashMap<(String, i32), i64> = HashMap::new();
    // A partition ending in transaction markers (or aborted records, which read_committed skips) has no
    // message at its last offsets: the consumer's position passes them.
    let at_ends = |read_up_to: &HashMap<(String, i32), i64>| {
        let positions = consumer.position().ok();
        ends.iter().all(|(topic, partition, high)| {
            let position = positions
                .as_ref()
                .and_then(|p| p.find_partition(topic, *partition))
                .and_then(|p| p.offset().to_raw())
                .unwrap_or(-1);
            *high == 0
                || position >= *high
                || read_up_to
                    .get(&(topic.clone(), *partition))
                    .copied()
                    .unwrap_or(-1)
                    + 1
                    >= *high
        })
    };
    while quiet_polls < 4 || records.len() < expected || !at_ends(&read_up_to) {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: read {} of {expected} records from {topics:?}; {}",
            records.len(),
            partitions_read(&consumer, &ends, &read_up_to)
        );
        match consumer.poll(Duration::from_millis(250)) {
            Some(Ok(message)) => {
                quiet_polls = 0;
                read_up_to.insert(
                    (message.topic().to_string(), message.partition()),
                    message.offset(),
                );
                records.push(Record::of(&message));
            }
            Some(Err(error)) => panic!("consumer error: {error}"),
            None => quiet_polls += 1,
        }
    }
    records
}

/// Where each partition's read stands against the end it had when reading began, for a timed-out read:
/// a position short of the end with nothing read says the last stable offset is stuck (an open or
/// hanging transaction); a position at the end says the records are not there.
fn partitions_read(
    consumer: &BaseConsumer,
    ends: &[(String, i32, i64)],
    read_up_to: &HashMap<(String, i32), i64>,
) -> String {
    let positions = consumer.position().ok();
    ends.iter()
        .map(|(topic, partition, high)| {
            let position = positions
                .as_ref()
                .and_then(|p| p.find_partition(topic, *partition))
                .and_then(|p| p.offset().to_raw());
            let last = read_up_to.get(&(topic.clone(), *partition));
            format!("{topic}[{partition}] end {high} position {position:?} last read {last:?}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One committed (or rolled-back) outbox event as the test inserted it.
#[derive(Debug, Clone)]
pub struct Inserted {
    pub event_id: uuid::Uuid,
    pub aggregate_id: String,
    pub seq: i64,
}

/// Inserts `txns` transactions of `per_txn` events over `aggregates` aggregates, the way an order service
/// does (business write and outbox rows in one transaction). Every `rollback_every`-th transaction rolls
/// back. Returns (committed in commit order, rolled back).
pub async fn insert_events(
    client: &mut tokio_postgres::Client,
    first_txn: usize,
    txns: usize,
    per_txn: usize,
    aggregates: usize,
    rollback_every: Option<usize>,
) -> (Vec<Inserted>, Vec<Inserted>) {
    let mut committed = Vec::new();
    let mut rolled_back = Vec::new();
    for t in first_txn..first_txn + txns {
        let tx = client.transaction().await.unwrap();
        let events = insert_txn_events(&tx, t, per_txn, aggregates).await;
        if rollback_every.is_some_and(|n| t % n == n - 1) {
            tx.rollback().await.unwrap();
            rolled_back.extend(events);
        } else {
            tx.commit().await.unwrap();
            committed.extend(events);
        }
    }
    (committed, rolled_back)
}

/// Inserts transaction number `t`'s `per_txn` events inside `tx` (several events of one aggregate in a row).
pub async fn insert_txn_events(
    tx: &tokio_postgres::Transaction<'_>,
    t: usize,
    per_txn: usize,
    aggregates: usize,
) -> Vec<Inserted> {
    try_insert_txn_events(tx, t, per_txn, aggregates)
        .await
        .expect("cannot insert outbox events")
}

/// [`insert_txn_events`] for writers that outlive a failing server.
pub async fn try_insert_txn_events(
    tx: &tokio_postgres::Transaction<'_>,
    t: usize,
    per_txn: usize,
    aggregates: usize,
) -> Result<Vec<Inserted>, tokio_postgres::Error> {
    let mut events = Vec::new();
    for i in 0..per_txn {
        let aggregate_id = format!("order-{}", (t * 7 + i / 3) % aggregates);
        let event_id = uuid::Uuid::new_v4();
        let seq = (t * per_txn + i) as i64;
        let payload = serde_json::json!({"order": aggregate_id, "seq": seq, "txn": t, "pad": "x".repeat(100)});
        tx.execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'Order', $2, $3, $4)",
            &[&event_id, &aggregate_id, &format!("OrderEvent{}", i % 3), &payload],
        )
        .await?;
        events.push(Inserted {
            event_id,
            aggregate_id,
            seq,
        });
    }
    Ok(events)
}

/// What a delivery check found.
#[derive(Debug, Default)]
pub struct DeliveryReport {
    pub missing: usize,
    pub from_rolled_back: usize,
    pub duplicates: usize,
    pub order_violations: usize,
    /// The first few missing events (seq, aggregate), to say which ones.
    pub missing_sample: Vec<(i64, String)>,
}

/// Compares what Kafka holds with what was committed: loss, rolled-back events, duplicates, and per-aggregate
/// order of first appearances against commit order.
pub fn check_delivery(
    records: &[Record],
    committed: &[Inserted],
    rolled_back: &[Inserted],
) -> DeliveryReport {
    let mut report = DeliveryReport::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    // Records in partition order: per key, a partition preserves produce order.
    let mut ordered: Vec<&Record> = records.iter().collect();
    ordered.sort_by_key(|r| (r.topic.clone(), r.partition, r.offset));
    let mut first_appearance: Vec<&Record> = Vec::new();
    for record in &ordered {
        let id = record.headers.get("event_id").cloned().unwrap_or_default();
        let count = seen.entry(id).or_default();
        *count += 1;
        if *count == 1 {
            first_appearance.push(record);
        } else {
            report.duplicates += 1;
        }
    }
    let missing: Vec<&Inserted> = committed
        .iter()
        .filter(|e| !seen.contains_key(&e.event_id.to_string()))
        .collect();
    report.missing = missing.len();
    report.missing_sample = missing
        .iter()
        .take(10)
        .map(|e| (e.seq, e.aggregate_id.clone()))
        .collect();
    report.from_rolled_back = rolled_back
        .iter()
        .filter(|e| seen.contains_key(&e.event_id.to_string()))
        .count();
    let commit_position: HashMap<String, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, e)| (e.event_id.to_string(), i))
        .collect();
    let mut last_per_aggregate: HashMap<String, usize> = HashMap::new();
    for record in first_appearance {
        let Some(&position) = record
            .headers
            .get("event_id")
            .and_then(|id| commit_position.get(id))
        else {
            continue;
        };
        let key = record.key.clone().unwrap_or_default();
        if let Some(&last) = last_per_aggregate.get(&key) {
            if position < last {
                report.order_violations += 1;
            }
        }
        last_per_aggregate.insert(key, position);
    }
    report
}

/// The partition the Java producer's default partitioner picks for `key` (outboxd's audit uses the same).
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    outboxd::audit::partitioner::partition_of(key, partitions)
}

// ---- shared scenario helpers ----

pub const TOPIC: &str = "outbox.Order";

/// An outbox table of the standard columns and nothing else: no `published_at`, no polling columns. A re-sent
/// event cannot be skipped by its row, so every re-send shows in Kafka as a duplicate.
pub const CDC_ONLY_TABLE: &str = "CREATE TABLE public.outbox_event (
    event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";

pub fn run_args<'a>(pg: &'a str, brokers: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--database-url",
        pg,
        "--brokers",
        brokers,
        "--topic-replication-factor",
        "1",
        "--status-interval",
        "200ms",
    ]
}

/// `outboxd run` (with `run_args` and `extra`) serving its endpoint on a free port; returns it and the address.
pub fn spawn_serving_metrics(url: &str, brokers: &str, extra: &[&str]) -> (Outboxd, String) {
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run_args(url, brokers);
    args.extend(["--metrics-addr", metrics_addr.as_str()]);
    args.extend(extra);
    (Outboxd::spawn(&args), metrics_addr)
}

/// Waits until `/readyz` at `metrics_addr` says 200.
pub fn wait_ready(metrics_addr: &str) {
    wait_for("/readyz to be 200", Duration::from_secs(60), || {
        http_get(metrics_addr, "/readyz").filter(|r| r.0 == 200)
    });
}

/// The plan PostgreSQL would follow for `sql`, as `EXPLAIN` prints it.
pub async fn plan_of(client: &tokio_postgres::Client, sql: &str) -> String {
    let lines: Vec<String> = client
        .query(&format!("EXPLAIN {sql}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    lines.join("\n")
}

/// Client tools (psql, pg_recvlogical) of Debian's PostgreSQL 15: they talk to every server of the matrix
/// (the other majors' server packages have none).
pub const PG_CLIENT_BIN: &str = "/usr/lib/postgresql/15/bin";

/// Another client (`pg_recvlogical`) streaming from `slot` of `pg`, until dropped.
pub struct OtherSlotClient(std::process::Child);

impl OtherSlotClient {
    /// Starts it; the slot must exist.
    pub fn start(pg: &Postgres, slot: &str) -> Self {
        let child = Command::new(format!("{PG_CLIENT_BIN}/pg_recvlogical"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &pg.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .args(["--slot", slot, "--start", "-f", "/dev/null"])
            .args(["-o", "proto_version=1", "-o", "publication_names=outboxd"])
            .spawn()
            .expect("pg_recvlogical");
        OtherSlotClient(child)
    }
}

impl Drop for OtherSlotClient {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `outbox_p`, partitioned by `created_at`: an old 2020 partition (past any retention window) and one for
/// everything since.
pub const PARTITIONED_TABLE: &str = "CREATE TABLE public.outbox_p (
                 event_id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (event_id, created_at)) PARTITION BY RANGE (created_at);
             CREATE TABLE public.outbox_p_2020 PARTITION OF outbox_p
                 FOR VALUES FROM ('2020-01-01 00:00:00+00') TO ('2021-01-01 00:00:00+00');
             CREATE TABLE public.outbox_p_now PARTITION OF outbox_p
                 FOR VALUES FROM ('2021-01-01 00:00:00+00') TO ('2200-01-01 00:00:00+00');";

/// `outboxd migrate` with `args`; returns its log.
pub fn migrate_with(url: &str, args: &[&str]) -> String {
    let mut argv = vec!["migrate", "--database-url", url];
    argv.extend_from_slice(args);
    let output = run_outboxd(&argv);
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "migrate failed: {stderr}");
    stderr
}

/// The default table `public.outbox_event`, inspected, for tests that call the library's SQL directly.
pub async fn outbox_event_table(client: &tokio_postgres::Client) -> outboxd::table::OutboxTable {
    outbox_table(client, "outbox_event").await
}

/// The table `public.<name>` (standard column names), inspected.
pub async fn outbox_table(
    client: &tokio_postgres::Client,
    name: &str,
) -> outboxd::table::OutboxTable {
    let spec = outboxd::table::TableSpec::new(
        outboxd::table::TableName {
            schema: "public".into(),
            name: name.into(),
        },
        Default::default(),
        &[],
        vec![],
    );
    outboxd::pg::slot::inspect(client, &spec)
        .await
        .unwrap_or_else(|e| panic!("cannot inspect public.{name}: {e}"))
}

pub fn migrate(pg: &Postgres) {
    let output = run_outboxd(&["migrate", "--database-url", &pg.url()]);
    assert!(
        output.status.success(),
        "migrate failed: {}",
        stderr_of(&output)
    );
}

/// Reads everything back and checks nothing committed is missing, nothing rolled back is present, and each
/// aggregate's events first appear in commit order. Returns the records and the report (for duplicates).
pub fn verify_delivery(
    brokers: &str,
    committed: &[Inserted],
    rolled_back: &[Inserted],
    timeout_secs: u64,
    what: &str,
) -> (Vec<Record>, DeliveryReport) {
    let records = consume_all(
        brokers,
        &[TOPIC],
        committed.len(),
        Duration::from_secs(timeout_secs),
    );
    let report = check_delivery(&records, committed, rolled_back);
    println!(
        "{what}: {} records for {} committed events: {report:?}",
        records.len(),
        committed.len()
    );
    assert_eq!(report.missing, 0, "{what}: committed events missing");
    assert_eq!(
        report.from_rolled_back, 0,
        "{what}: rolled-back events published"
    );
    assert_eq!(
        report.order_violations, 0,
        "{what}: per-aggregate order violated"
    );
    (records, report)
}

/// [`verify_delivery`] for a run without faults: nothing may go out twice either.
pub fn verify_fault_free_delivery(
    brokers: &str,
    committed: &[Inserted],
    rolled_back: &[Inserted],
    timeout_secs: u64,
    what: &str,
) -> Vec<Record> {
    let (records, report) = verify_delivery(brokers, committed, rolled_back, timeout_secs, what);
    assert_eq!(report.duplicates, 0, "{what}: duplicates without a fault");
    records
}

/// A migrated PostgreSQL cluster and a broker, both stopped on drop.
pub fn migrated_stack() -> (Postgres, Broker) {
    let pg = Postgres::start();
    let broker = Broker::start();
    migrate(&pg);
    (pg, broker)
}

/// The slot exists for good and a walsender streams from it. (While CREATE_REPLICATION_SLOT still waits for
/// its consistent point the slot already shows as active, and a client killed then leaves no slot behind.)
pub async fn slot_active(client: &tokio_postgres::Client, slot: &str) -> Option<()> {
    client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming')",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .map(|_| ())
}

/// How many replication slots named `slot` exist (0 or 1).
pub async fn slot_count(client: &tokio_postgres::Client, slot: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("pg_replication_slots")
        .get(0)
}

pub async fn wait_slot_active(client: &tokio_postgres::Client, slot: &str) {
    wait_for_async(
        &format!("slot {slot} to be active"),
        Duration::from_secs(60),
        || slot_active(client, slot),
    )
    .await;
}

/// Waits until the walsender has sent everything written so far: read by outboxd (its window has room),
/// so in its open Kafka transaction when exactly-once.
pub async fn wait_sent_up_to_now(client: &tokio_postgres::Client) {
    let written = current_wal_lsn(client).await;
    wait_for_async(
        "outboxd to read the load",
        Duration::from_secs(60),
        || async {
            let row = client
                .query_one(
                    "SELECT coalesce(max(sent_lsn)::text, '0/0') FROM pg_stat_replication",
                    &[],
                )
                .await
                .unwrap();
            let sent: outboxd::lsn::Lsn = row.get::<_, String>(0).parse().unwrap();
            (sent >= written).then_some(())
        },
    )
    .await;
}

/// How many of `events` have `published_at` set.
pub async fn published_among(client: &tokio_postgres::Client, events: &[Inserted]) -> i64 {
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.event_id).collect();
    client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL AND event_id = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0)
}

pub async fn unpublished(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits until every row is published, failing at once (not at the timeout) when one was dead-lettered.
pub async fn wait_all_published(client: &tokio_postgres::Client, timeout: Duration) {
    wait_settled(client, timeout).await;
    let dead = dead_count(client).await;
    assert_eq!(
        dead, 0,
        "{dead} rows were dead-lettered instead of published"
    );
}

/// Waits until no row is waiting: each is published or dead-lettered.
pub async fn wait_settled(client: &tokio_postgres::Client, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    let waiting = || async {
        client
            .query_one(
                "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND dead_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    while waiting().await > 0 {
        if std::time::Instant::now() > deadline {
            let state = client
                .query_one(
                    "SELECT count(*), count(*) FILTER (WHERE handoff_at IS NOT NULL),
                            count(*) FILTER (WHERE lease_until > now()), count(*) FILTER (WHERE dead_at IS NOT NULL),
                            max(attempts), max(last_error)
                     FROM outbox_event WHERE published_at IS NULL",
                    &[],
                )
                .await
                .ok()
                .map(|r| {
                    format!(
                        "unpublished {}, handed off {}, leased {}, dead {}, max attempts {:?}, an error {:?}",
                        r.get::<_, i64>(0),
                        r.get::<_, i64>(1),
                        r.get::<_, i64>(2),
                        r.get::<_, i64>(3),
                        r.get::<_, Option<i32>>(4),
                        r.get::<_, Option<String>>(5)
                    )
                });
            panic!(
                "timed out after {timeout:?} waiting for every row to be published or dead-lettered: {state:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> outboxd::lsn::Lsn {
    let text: Option<String> = client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    text.unwrap_or_default().parse().unwrap_or_default()
}

/// Waits until `slot` has confirmed `lsn` (or more); returns what it confirmed.
pub async fn wait_confirmed_past(
    client: &tokio_postgres::Client,
    slot: &str,
    lsn: outboxd::lsn::Lsn,
    what: &str,
) -> outboxd::lsn::Lsn {
    wait_for_async(what, Duration::from_secs(120), || async {
        let confirmed = confirmed_flush(client, slot).await;
        (confirmed >= lsn).then_some(confirmed)
    })
    .await
}

pub async fn current_wal_lsn(client: &tokio_postgres::Client) -> outboxd::lsn::Lsn {
    let text: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    text.parse().unwrap()
}

/// A TCP proxy the tests own, for cutting the network between outboxd and a server: `cut` drops every
/// connection and refuses new ones until `restore`.
pub struct Proxy {
    pub port: u16,
    accepting: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
    /// While true, connections stay open but no byte is forwarded (a stalled network or broker).
    stalled: tokio::sync::watch::Sender<bool>,
    connections: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port and forwards to `target_port` (call `forward_to` later if unknown yet).
    pub fn start(target_port: std::sync::Arc<std::sync::atomic::AtomicU16>) -> Self {
        let port = free_port();
        let (accepting, mut state) = tokio::sync::watch::channel(true);
        let accepting = std::sync::Arc::new(accepting);
        let connections =
            std::sync::Arc::new(std::sync::Mutex::new(Vec::<tokio::task::AbortHandle>::new()));
        let conns = connections.clone();
        let still_accepting = accepting.clone();
        let (stalled, stall_state) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            loop {
                if state.wait_for(|on| *on).await.is_err() {
                    return;
                }
                let listener = match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
                    Ok(listener) => listener,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                loop {
                    tokio::select! {
                        accepted = listener.accept() => {
                            let Ok((inbound, _)) = accepted else { continue };
                            // Under the lock `cut` holds while it flips the state and aborts: a
                            // connection accepted as it cuts is either aborted by it or dropped here,
                            // never left open (a client reconnecting at once could otherwise keep one).
                            let mut open = conns.lock().unwrap();
                            if !*still_accepting.borrow() {
                                continue;
                            }
                            let target = target_port.load(std::sync::atomic::Ordering::SeqCst);
                            let stall = stall_state.clone();
                            let pipe = tokio::spawn(async move {
                                if let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await {
                                    let (in_read, in_write) = inbound.into_split();
                                    let (out_read, out_write) = outbound.into_split();
                                    tokio::select! {
                                        _ = pump(in_read, out_write, stall.clone()) => {}
                                        _ = pump(out_read, in_write, stall) => {}
                                    }
                                }
                            });
                            open.push(pipe.abort_handle());
                        }
                        _ = state.wait_for(|on| !*on) => break,
                    }
                }
                // Listener dropped here: new connections are refused until restored.
            }
        });
        Proxy {
            port,
            accepting,
            stalled,
            connections,
            task,
        }
    }

    /// Holds every byte in both directions until `resume`, keeping connections open.
    pub fn stall(&self) {
        let _ = self.stalled.send(true);
    }

    pub fn resume(&self) {
        let _ = self.stalled.send(false);
    }

    pub fn cut(&self) {
        let mut open = self.connections.lock().unwrap();
        let _ = self.accepting.send(false);
        for connection in open.drain(..) {
            connection.abort();
        }
    }

    pub fn restore(&self) {
        let _ = self.accepting.send(true);
    }
}

/// Copies bytes from `from` to `to`, holding them while `stalled` is true.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

impl Broker {
    /// A broker whose clients all go through a [`Proxy`] (it advertises the proxy's address).
    pub fn start_behind_proxy() -> (Broker, Proxy) {
        Self::start_behind_proxy_with(None)
    }

    /// Like `start_behind_proxy`, with storage that survives `stop` and `start_again` (Kafka's always does;
    /// tansu's only with its sqlite engine, asked for here).
    pub fn start_persistent_behind_proxy() -> (Broker, Proxy) {
        Self::start_behind_proxy_with(Some("sqlite://tansu.db".into()))
    }

    fn start_behind_proxy_with(storage: Option<String>) -> (Broker, Proxy) {
        let port = free_port();
        let proxy = Proxy::start(std::sync::Arc::new(std::sync::atomic::AtomicU16::new(port)));
        let broker = Broker {
            dir: scratch_dir("broker"),
            port,
            advertised: Some(proxy.port),
            storage,
        };
        broker.start_again();
        (broker, proxy)
    }

    /// The address clients should use when the broker is behind a proxy.
    pub fn proxied_addr(proxy: &Proxy) -> String {
        format!("127.0.0.1:{}", proxy.port)
    }
}

/// How often the polling path claimed event `id` (`attempts`).
pub async fn attempts_of(client: &tokio_postgres::Client, id: uuid::Uuid) -> i32 {
    client
        .query_one(
            "SELECT attempts FROM outbox_event WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

/// Dead-lettered rows (`dead_at` set).
pub async fn dead_count(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Rows handed to the polling path (`handoff_at` set), published or not.
pub async fn handed_off_count(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE handoff_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A plain HTTP GET: (status code, body), or `None` when nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    http_request("GET", addr, path, None)
}

/// A plain HTTP/1.0 request (so the answer is never chunked), with a JSON body if given: (status code, body),
/// or `None` when nothing answers.
pub fn http_request(
    method: &str,
    addr: &str,
    path: &str,
    json_body: Option<&str>,
) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let body = json_body.unwrap_or("");
    let content_type = if json_body.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{content_type}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// The value of the first sample line of `metric` (with `labels`, e.g. `path="cdc"`), from Prometheus text.
pub fn metric_value(text: &str, metric: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            let matches = if labels.is_empty() {
                name == metric
            } else {
                name.starts_with(&format!("{metric}{{")) && name.contains(labels)
            };
            matches.then(|| value.parse().ok()).flatten()
        })
}

/// A program of the tests' Python tools (`install-deps.sh` installs them into a virtual environment under
/// the cache): `kubernetes-validate`, `python` (with the CloudEvents SDK).
pub fn python_tool(name: &str) -> PathBuf {
    let cache = std::env::var("OUTBOXD_CACHE").unwrap_or_else(|_| "/var/cache/outboxd".into());
    let tool = Path::new(&cache).join("python-tools/bin").join(name);
    assert!(
        tool.exists(),
        "{} is missing: run `bash tests/support/install-deps.sh`",
        tool.display()
    );
    tool
}

/// The outboxd metrics a PromQL expression reads, histograms by their base name (`_bucket`, `_count` and
/// `_sum` cut off).
pub fn metrics_in(expr: &str) -> std::collections::BTreeSet<String> {
    let mut used = std::collections::BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("outboxd_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
        used.insert(base.to_string());
    }
    used
}

/// outboxd's `outboxd_inflight_events` gauge, read from its `/metrics` at `metrics_addr` (None while it
/// does not answer).
pub fn in_flight_events(metrics_addr: &str) -> Option<f64> {
    let (status, metrics) = http_get(metrics_addr, "/metrics")?;
    if status != 200 {
        return None;
    }
    metric_value(&metrics, outboxd::metrics::INFLIGHT_EVENTS, "")
}

/// The walsender streaming from `slot`, if any.
pub async fn slot_walsender(client: &tokio_postgres::Client, slot: &str) -> Option<i32> {
    slot_active(client, slot).await?;
    client
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .ok()
        .flatten()
        .and_then(|row| row.get(0))
}

/// Waits until one of outboxd's hand-offs (an UPDATE setting `handoff_at`) waits for a lock.
pub async fn wait_hand_off_waiting_on_a_lock(
    client: &tokio_postgres::Client,
    what: &str,
    timeout: Duration,
) {
    wait_for_async(what, timeout, || async {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%handoff_at = now()%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (waiting > 0).then_some(())
    })
    .await;
}

/// Runs outboxd until a walsender streams from its new slot, then SIGKILLs it: the slot exists, nothing streams.
pub async fn create_slot_then_stop(url: &str, brokers: &str, client: &tokio_postgres::Client) {
    let mut outboxd = Outboxd::spawn(&run_args(url, brokers));
    wait_slot_active(client, "outboxd").await;
    let walsender = slot_walsender(client, "outboxd").await;
    outboxd.kill();
    wait_walsender_gone(client, walsender).await;
}

/// Waits until the walsender `walsender` (of an outboxd killed) has exited. It notices its client is gone a
/// moment later: until then the slot (or the replication connection) looks held by some other client.
pub async fn wait_walsender_gone(client: &tokio_postgres::Client, walsender: Option<i32>) {
    wait_for_async(
        "the killed outboxd's walsender to exit",
        Duration::from_secs(60),
        || async {
            let gone: bool = client
                .query_one(
                    "SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)",
                    &[&walsender],
                )
                .await
                .ok()?
                .get(0);
            gone.then_some(())
        },
    )
    .await;
}

/// SIGKILLs `outboxd` while it streams a round committed while it was down (the WAL from `start` to `end`):
/// once the slot confirmed part of it, and asserting that it had not confirmed all of it.
pub async fn kill_mid_round(
    client: &tokio_postgres::Client,
    outboxd: &mut Outboxd,
    start: outboxd::lsn::Lsn,
    end: outboxd::lsn::Lsn,
) {
    wait_for_async(
        "the slot to confirm part of the round",
        Duration::from_secs(60),
        || async { (confirmed_flush(client, "outboxd").await > start).then_some(()) },
    )
    .await;
    outboxd.kill();
    let confirmed = confirmed_flush(client, "outboxd").await;
    assert!(
        confirmed < end,
        "the kill landed after the whole round was confirmed ({confirmed}, round ends at {end})"
    );
}

/// A field of /proc/<pid>/status in KiB: `VmRSS` (now) or `VmHWM` (peak).
pub fn memory_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} for pid {pid}"))
}

/// The role README's set-up step 2 makes, with exactly its grants (`LOGIN REPLICATION`, `SELECT, UPDATE` on
/// the outbox `table`) and then `extra_grants` (SQL run as the admin, for what an option needs on top),
/// allowed in by password; returns its URL.
pub async fn readme_role(pg: &Postgres, password: &str, table: &str, extra_grants: &str) -> String {
    let admin = pg.client().await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE outboxd_app LOGIN REPLICATION PASSWORD '{password}';
             GRANT SELECT, UPDATE ON {table} TO outboxd_app;
             {extra_grants}"
        ))
        .await
        .unwrap();
    pg.prepend_hba("host all outboxd_app 127.0.0.1/32 scram-sha-256")
        .await;
    pg.url_for("outboxd_app", Some(password))
}

/// An admin client of the broker at `brokers`.
pub fn admin(brokers: &str) -> rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("cannot create admin client")
}

/// Creates `topic`; fails the test if the broker refuses.
pub async fn create_topic(brokers: &str, topic: rdkafka::admin::NewTopic<'_>) {
    let results = admin(brokers)
        .create_topics([&topic], &rdkafka::admin::AdminOptions::new())
        .await
        .expect("cannot create topic");
    for result in results {
        result.expect("cannot create topic");
    }
}

/// Makes PostgreSQL invalidate `slot` (`wal_status = lost`) the way a real incident does: a
/// `max_slot_wal_keep_size` of 1MB, WAL written past it, checkpoints until the WAL the slot needs is gone. Call
/// it while nothing streams from the slot (outboxd stopped).
pub async fn lose_slot(client: &tokio_postgres::Client, slot: &str) {
    for statement in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        "SELECT pg_reload_conf()",
        "CREATE TABLE IF NOT EXISTS wal_filler (x text)",
    ] {
        client.batch_execute(statement).await.unwrap();
    }
    wait_for_async("the slot to be lost", Duration::from_secs(60), || async {
        for statement in [
            "INSERT INTO wal_filler SELECT repeat('x', 1000) FROM generate_series(1, 5000)",
            "SELECT pg_switch_wal()",
            "CHECKPOINT",
        ] {
            client.batch_execute(statement).await.unwrap();
        }
        let status: Option<String> = client
            .query_one(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        (status.as_deref() == Some("lost")).then_some(())
    })
    .await;
}

/// Drops the slot `outboxd` under a running outboxd: terminate its walsender, drop, retry until it sticks
/// (a fresh connection each time, so it also works right after a server restart).
pub async fn drop_slot_while_streaming(pg: &Postgres) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let client = pg.client().await;
        let dropped = client
            .batch_execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'outboxd' AND active_pid IS NOT NULL;
                 SELECT pg_drop_replication_slot('outboxd');",
            )
            .await;
        if dropped.is_ok() {
            return;
        }
        assert!(Instant::now() < deadline, "could not drop the slot");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---- A secure Apache Kafka node: SASL_SSL (SCRAM-SHA-512), its own CA, ACLs (tests/kafka_security.rs) ----

/// The super user of every [`SecureBroker`] (created when its storage is formatted).
pub const SECURE_ADMIN: &str = "admin";
pub const SECURE_ADMIN_PASSWORD: &str = "admin-secret";

/// One Apache Kafka node (`kafka.sh start-secure`; Apache Kafka whatever `OUTBOXD_TEST_BROKER` says) whose
/// clients must use SASL_SSL with SCRAM-SHA-512 and trust [`SecureBroker::ca`], the CA made for it; its
/// StandardAuthorizer allows nothing without an ACL, except to the super user [`SECURE_ADMIN`]. Stopped on drop.
pub struct SecureBroker {
    pub dir: PathBuf,
    /// The SASL_SSL listener, the one clients use.
    pub port: u16,
    /// PEM certificate of the CA that signed the broker's certificate (IP:127.0.0.1, DNS:localhost).
    pub ca: PathBuf,
    /// The broker's own PLAINTEXT listener on loopback, whose principal (ANONYMOUS) is a super user: for
    /// reading records back with the plain helpers (`consume_all`, `verify_delivery`).
    pub plaintext_port: u16,
}

impl SecureBroker {
    pub fn start() -> Self {
        let dir = scratch_dir("secure-broker");
        let port = free_port();
        run_script(
            "kafka.sh",
            &["start-secure", dir.to_str().unwrap(), &port.to_string()],
            &[("KAFKA_ADMIN_PASSWORD", SECURE_ADMIN_PASSWORD)],
        );
        let plaintext_port = std::fs::read_to_string(dir.join("plaintext.port"))
            .expect("kafka.sh start-secure wrote no plaintext.port")
            .trim()
            .parse()
            .unwrap();
        SecureBroker {
            ca: dir.join("tls/ca.crt"),
            dir,
            port,
            plaintext_port,
        }
    }

    /// `--brokers` for clients (SASL_SSL).
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The super user's way in without credentials (see `plaintext_port`).
    pub fn plaintext_addr(&self) -> String {
        format!("127.0.0.1:{}", self.plaintext_port)
    }

    /// outboxd's `--kafka-option` arguments to connect as `user`, trusting `ca`.
    pub fn kafka_options(user: &str, password: &str, ca: &Path) -> Vec<String> {
        [
            "security.protocol=SASL_SSL".to_string(),
            "sasl.mechanism=SCRAM-SHA-512".to_string(),
            format!("sasl.username={user}"),
            format!("sasl.password={password}"),
            format!("ssl.ca.location={}", ca.display()),
        ]
        .into_iter()
        .flat_map(|option| ["--kafka-option".to_string(), option])
        .collect()
    }

    /// A SCRAM-SHA-512 user; returns once it can log in.
    pub fn add_user(&self, name: &str, password: &str) {
        run_script(
            "kafka.sh",
            &["add-user", self.dir.to_str().unwrap(), name, password],
            &[],
        );
    }

    /// ALLOW ACLs for `User:<user>`, one per operation (`WRITE`, `CREATE`, `DESCRIBE`, `READ`, ...) on the
    /// `resource_type` (`TOPIC`, `GROUP`, `CLUSTER`, ...) named `resource` (literally); returns once the
    /// broker enforces them.
    pub fn allow(&self, user: &str, operations: &[&str], resource_type: &str, resource: &str) {
        self.acls("allow", user, operations, resource_type, &[resource]);
    }

    /// ALLOW ACLs as [`SecureBroker::allow`] makes them, for every resource whose name starts with `prefix`.
    pub fn allow_prefixed(
        &self,
        user: &str,
        operations: &[&str],
        resource_type: &str,
        prefix: &str,
    ) {
        self.acls(
            "allow",
            user,
            operations,
            resource_type,
            &[prefix, "PREFIXED"],
        );
    }

    /// Removes the ALLOW ACLs [`SecureBroker::allow`] made; returns once the broker no longer enforces them.
    pub fn revoke(&self, user: &str, operations: &[&str], resource_type: &str, resource: &str) {
        self.acls("revoke", user, operations, resource_type, &[resource]);
    }

    /// `kafka.sh allow|revoke DIR USER OPERATIONS RESOURCE_TYPE RESOURCE [PATTERN]`.
    fn acls(
        &self,
        command: &str,
        user: &str,
        operations: &[&str],
        resource_type: &str,
        resource: &[&str],
    ) {
        let operations = operations.join(",");
        let mut args = vec![
            command,
            self.dir.to_str().unwrap(),
            user,
            &operations,
            resource_type,
        ];
        args.extend_from_slice(resource);
        run_script("kafka.sh", &args, &[]);
    }

    /// `user` may produce to `topic` (WRITE, which implies DESCRIBE and the idempotent producer's id).
    pub fn allow_write(&self, user: &str, topic: &str) {
        self.allow(user, &["WRITE"], "TOPIC", topic);
    }

    /// `user` may create `topic`.
    pub fn allow_create(&self, user: &str, topic: &str) {
        self.allow(user, &["CREATE"], "TOPIC", topic);
    }
}

impl Drop for SecureBroker {
    fn drop(&mut self) {
        run_script("kafka.sh", &["stop", self.dir.to_str().unwrap()], &[]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

// ======================================================================================================
// Cluster: three Apache Kafka nodes (combined broker + controller, KRaft, static quorum) for broker failover
// (tests/chaos.rs). Started by `kafka.sh start-cluster` (replication factor 3, min.insync.replicas=2); nodes
// are numbered 1..=3 as their `node.id`, so metadata's broker ids are node numbers. Stopped on drop, by the
// pid files the script writes.
// ======================================================================================================

/// One partition as the cluster's metadata shows it.
#[derive(Debug, Clone)]
pub struct PartitionState {
    pub id: i32,
    /// -1 while the partition has no leader.
    pub leader: i32,
    pub replicas: Vec<i32>,
    pub isr: Vec<i32>,
}

pub struct Cluster {
    pub dir: PathBuf,
    /// Client port of node n at `ports[n - 1]`.
    pub ports: [u16; 3],
    /// Metadata and watermark queries (a consumer without a group that never reads).
    client: BaseConsumer,
}

impl Cluster {
    pub const NODES: [i32; 3] = [1, 2, 3];

    /// Starts three nodes and waits until each has started.
    pub fn launch() -> Self {
        let dir = scratch_dir("kafka-cluster");
        let ports = [free_port(), free_port(), free_port()];
        let port_args: Vec<String> = ports.iter().map(|p| p.to_string()).collect();
        run_script(
            "kafka.sh",
            &[
                "start-cluster",
                dir.to_str().unwrap(),
                &port_args[0],
                &port_args[1],
                &port_args[2],
            ],
            &[],
        );
        let client = Self::metadata_client(&ports, &Self::NODES);
        Cluster { dir, ports, client }
    }

    /// A client that asks only `nodes` (a hung node would hold its requests for `socket.timeout.ms`).
    fn metadata_client(ports: &[u16; 3], nodes: &[i32]) -> BaseConsumer {
        let bootstrap: Vec<String> = nodes
            .iter()
            .map(|&n| format!("127.0.0.1:{}", ports[n as usize - 1]))
            .collect();
        // No group.id: a consumer with one looks for its coordinator, which creates __consumer_offsets (50
        // more partitions to replicate through every failure).
        ClientConfig::new()
            .set("bootstrap.servers", bootstrap.join(","))
            .set("socket.timeout.ms", "10000")
            .create()
            .expect("cannot create the cluster's metadata client")
    }

    /// The bootstrap list of all three nodes, for `--brokers`.
    pub fn addrs(&self) -> String {
        self.ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn node_dir(&self, n: i32) -> PathBuf {
        assert!(Self::NODES.contains(&n), "no node {n} in a 3-node cluster");
        self.dir.join(format!("node{n}"))
    }

    /// SIGKILLs node `n` (a crash: no controlled shutdown) and waits until the process is gone.
    pub fn kill(&self, n: i32) {
        run_script(
            "kafka.sh",
            &["kill", self.node_dir(n).to_str().unwrap()],
            &[],
        );
    }

    /// Stops node `n` (SIGTERM: controlled shutdown, then SIGKILL after 10 s).
    pub fn stop(&self, n: i32) {
        run_script(
            "kafka.sh",
            &["stop", self.node_dir(n).to_str().unwrap()],
            &[],
        );
    }

    /// Starts node `n` again with its data and configuration; waits until it has started.
    pub fn start(&self, n: i32) {
        run_script(
            "kafka.sh",
            &["start-node", self.node_dir(n).to_str().unwrap()],
            &[],
        );
    }

    /// SIGSTOPs node `n`: a hung broker (a long GC pause, a frozen VM). Its connections stay open and
    /// nothing on them is answered until `resume`.
    pub fn pause(&self, n: i32) {
        self.signal(n, "-STOP");
    }

    /// SIGCONTs node `n` after `pause`.
    pub fn resume(&self, n: i32) {
        self.signal(n, "-CONT");
    }

    fn signal(&self, n: i32, signal: &str) {
        let pid_file = self.node_dir(n).join("kafka.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("node {n} is not running ({}: {e})", pid_file.display()));
        let status = Command::new("kill")
            .args([signal, pid.trim()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {} (node {n})", pid.trim());
    }

    /// The partitions of `topic`, or `None` while no node answers or the topic has no metadata.
    pub fn partitions(&self, topic: &str) -> Option<Vec<PartitionState>> {
        Self::partitions_from(&self.client, topic)
    }

    fn partitions_from(client: &BaseConsumer, topic: &str) -> Option<Vec<PartitionState>> {
        let metadata = client
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()?;
        let t = metadata.topics().iter().find(|t| t.name() == topic)?;
        if t.error().is_some() || t.partitions().is_empty() {
            return None;
        }
        let mut partitions: Vec<PartitionState> = t
            .partitions()
            .iter()
            .map(|p| PartitionState {
                id: p.id(),
                leader: p.leader(),
                replicas: p.replicas().to_vec(),
                isr: p.isr().to_vec(),
            })
            .collect();
        partitions.sort_by_key(|p| p.id);
        Some(partitions)
    }

    /// The high watermark of each partition of `topic` (`None` for one whose leader does not answer).
    pub fn high_watermarks(&self, topic: &str) -> Vec<(i32, Option<i64>)> {
        self.partitions(topic)
            .unwrap_or_default()
            .iter()
            .map(|p| {
                let high = self
                    .client
                    .fetch_watermarks(topic, p.id, Duration::from_secs(5))
                    .ok()
                    .map(|(_, high)| high);
                (p.id, high)
            })
            .collect()
    }

    /// Every record of `topic`, read from the beginning up to each partition's high watermark as it is
    /// now (everything acknowledged so far). Unlike reading until a count arrived, a record that is not
    /// there shows up as missing instead of a time-out.
    pub fn read_all(&self, topic: &str, timeout: Duration) -> Vec<Record> {
        let ends: Vec<(i32, i64)> = wait_for(
            &format!("the high watermark of every partition of {topic}"),
            timeout,
            || {
                let marks = self.high_watermarks(topic);
                let ends: Option<Vec<(i32, i64)>> =
                    marks.iter().map(|&(p, high)| Some((p, high?))).collect();
                ends.filter(|e| !e.is_empty())
            },
        );
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.addrs())
            .set("group.id", format!("outboxd-test-{}", uuid::Uuid::new_v4()))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("cannot create consumer");
        let mut assignment = TopicPartitionList::new();
        let mut next: HashMap<i32, i64> = HashMap::new();
        for &(partition, _) in &ends {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .unwrap();
            next.insert(partition, 0);
        }
        consumer.assign(&assignment).unwrap();
        let mut records = Vec::new();
        let deadline = Instant::now() + timeout;
        while ends.iter().any(|(p, end)| next[p] < *end) {
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} reading {topic} up to {ends:?}: at {next:?}"
            );
            match consumer.poll(Duration::from_millis(250)) {
                Some(Ok(message)) => {
                    next.insert(message.partition(), message.offset() + 1);
                    records.push(Record::of(&message));
                }
                Some(Err(error)) => panic!("consumer error: {error}"),
                None => {}
            }
        }
        records
    }

    /// (partition, its leader node, its high watermark) for the partition holding the most records, the one
    /// receiving most of the load: keys hash over partitions unevenly and stay put, so the partition with the
    /// highest high watermark is the one most of the traffic goes to. Waits until every partition has a
    /// leader that answers.
    pub fn leader_of_busiest_partition(&self, topic: &str) -> (i32, i32, i64) {
        wait_for(
            &format!("the leader of the busiest partition of {topic}"),
            Duration::from_secs(60),
            || {
                let partitions = self.partitions(topic)?;
                if partitions.iter().any(|p| p.leader < 0) {
                    return None;
                }
                let marks = self.high_watermarks(topic);
                if marks.len() != partitions.len() || marks.iter().any(|(_, h)| h.is_none()) {
                    return None;
                }
                let (partition, high) = marks
                    .iter()
                    .map(|&(p, h)| (p, h.unwrap()))
                    .max_by_key(|&(p, h)| (h, -p))?;
                let leader = partitions.iter().find(|p| p.id == partition)?.leader;
                Some((partition, leader, high))
            },
        )
    }

    /// Waits until every partition of `topic` has a leader among the nodes not in `down` (killed, stopped
    /// or paused; asking only the others); returns the partitions then.
    pub fn wait_leaders_elected(
        &self,
        topic: &str,
        down: &[i32],
        timeout: Duration,
    ) -> Vec<PartitionState> {
        let up: Vec<i32> = Self::NODES
            .into_iter()
            .filter(|n| !down.contains(n))
            .collect();
        let client = Self::metadata_client(&self.ports, &up);
        wait_for(
            &format!("every partition of {topic} to have a leader other than nodes {down:?}"),
            timeout,
            || {
                let partitions = Self::partitions_from(&client, topic)?;
                partitions
                    .iter()
                    .all(|p| p.leader >= 0 && !down.contains(&p.leader))
                    .then_some(partitions)
            },
        )
    }

    /// Waits until every partition of `topic` has a leader and all three nodes in its ISR.
    pub fn wait_in_sync(&self, topic: &str, timeout: Duration) -> Vec<PartitionState> {
        wait_for(
            &format!("all three nodes in the ISR of every partition of {topic}"),
            timeout,
            || {
                let partitions = self.partitions(topic)?;
                partitions
                    .iter()
                    .all(|p| p.leader >= 0 && Self::NODES.iter().all(|n| p.isr.contains(n)))
                    .then_some(partitions)
            },
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A paused node would sit out its SIGTERM for the stop's full grace period.
        for n in Self::NODES {
            if let Ok(pid) = std::fs::read_to_string(self.node_dir(n).join("kafka.pid")) {
                let _ = Command::new("kill").args(["-CONT", pid.trim()]).status();
            }
        }
        run_script("kafka.sh", &["stop", self.dir.to_str().unwrap()], &[]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
// ======================================================================================================
// End of Cluster.
// ======================================================================================================
