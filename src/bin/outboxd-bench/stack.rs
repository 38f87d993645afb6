//! The benchmark's world: a throwaway PostgreSQL cluster and Kafka broker started with the scripts the tests
//! use (`tests/support/*.sh`), outboxd processes, and what `/proc` says about them. Everything started here
//! is stopped on drop, by PID. No measurement logic.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub type BenchResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(name)
}

fn run_script(name: &str, args: &[&str]) -> BenchResult<()> {
    let output = Command::new("bash").arg(script(name)).args(args).output()?;
    if !output.status.success() {
        return Err(format!(
            "{name} {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    Ok(())
}

pub fn free_port() -> BenchResult<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// PostgreSQL (wal_level=logical) and a broker, in `dir`.
pub struct Stack {
    dir: PathBuf,
    pub pg_port: u16,
    pub broker_port: u16,
}

impl Stack {
    pub fn start(dir: &Path) -> BenchResult<Self> {
        // PostgreSQL needs absolute paths (its socket directory).
        let dir = std::path::absolute(dir)?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let stack = Stack {
            dir,
            pg_port: free_port()?,
            broker_port: free_port()?,
        };
        run_script(
            "pg.sh",
            &["start", &stack.path("pg"), &stack.pg_port.to_string()],
        )?;
        run_script(
            "broker.sh",
            &[
                "start",
                &stack.path("broker"),
                &stack.broker_port.to_string(),
            ],
        )?;
        Ok(stack)
    }

    fn path(&self, what: &str) -> String {
        self.dir.join(what).display().to_string()
    }

    pub fn pg_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.pg_port)
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.broker_port)
    }

    pub fn log_dir(&self) -> PathBuf {
        self.dir.clone()
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = run_script("broker.sh", &["stop", &self.path("broker")]);
        let _ = run_script("pg.sh", &["stop", &self.path("pg")]);
    }
}

/// The release `outboxd` binary next to this one, built first when missing or older than the bench.
pub fn outboxd_binary() -> BenchResult<PathBuf> {
    let me = std::env::current_exe()?;
    let binary = me.with_file_name("outboxd");
    let stale = match (binary.metadata(), me.metadata()) {
        (Ok(outboxd), Ok(bench)) => outboxd.modified()? < bench.modified()?,
        _ => true,
    };
    if stale {
        let release = me.parent().is_some_and(|dir| dir.ends_with("release"));
        let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build
            .args(["build", "--bin", "outboxd"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if release {
            build.arg("--release");
        }
        if !build.status()?.success() {
            return Err("cargo build --bin outboxd failed".into());
        }
    }
    Ok(binary)
}

/// One outboxd process, logging to a file; SIGTERMed (then killed) on drop.
pub struct Outboxd {
    child: Child,
}

impl Outboxd {
    /// `OUTBOXD_BENCH_WRAP` (e.g. `perf record -g -o /tmp/perf.data --`) runs outboxd under a profiler.
    pub fn spawn(binary: &Path, args: &[&str], log: &Path) -> BenchResult<Self> {
        let file = std::fs::File::create(log)?;
        let wrap = std::env::var("OUTBOXD_BENCH_WRAP").unwrap_or_default();
        let mut wrap = wrap.split_whitespace();
        let mut command = match wrap.next() {
            Some(program) => {
                let mut command = Command::new(program);
                command.args(wrap).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        let child = command
            .args(args)
            .env("RUST_LOG", "warn")
            // No metrics listener unless the scenario passes --metrics-addr (flags win over env).
            .env("OUTBOXD_METRICS_ADDR", "off")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()?;
        Ok(Outboxd { child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CPU time (all threads) and peak RSS so far.
    pub fn usage(&self) -> BenchResult<Usage> {
        usage(self.child.id())
    }

    /// SIGTERM, then wait (SIGKILL after 30 s).
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Outboxd {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub cpu_seconds: f64,
    pub peak_rss_kib: u64,
}

impl std::ops::Add for Usage {
    type Output = Usage;
    fn add(self, other: Usage) -> Usage {
        Usage {
            cpu_seconds: self.cpu_seconds + other.cpu_seconds,
            peak_rss_kib: self.peak_rss_kib.max(other.peak_rss_kib),
        }
    }
}

/// utime + stime of every thread (from /proc/PID/stat) and VmHWM (from /proc/PID/status).
pub fn usage(pid: u32) -> BenchResult<Usage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest)
        .ok_or("unexpected /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let peak_rss_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or("no VmHWM")?;
    Ok(Usage {
        cpu_seconds: ticks / clock_ticks_per_second(),
        peak_rss_kib,
    })
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Polls `check` every `every` until it returns true or `timeout` passes.
pub async fn wait_until<F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: F,
) -> BenchResult<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        if Instant::now() > deadline {
            return Err(format!("timed out after {timeout:?} waiting for {what}").into());
        }
        tokio::time::sleep(every).await;
    }
    Ok(())
}
