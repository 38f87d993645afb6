//! The benchmark's world: a throwaway PostgreSQL cluster and Kafka broker started with the scripts the tests
//! use (`tests/support/*.sh`), outboxd processes, and what `/proc` says about them. Everything started here
//! is stopped on drop, by PID. No measurement logic.

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
    // The JVM's own defaults for the broker (the tests' quick-start options would make it the bottleneck).
    let output = Command::new("bash")
        .arg(script(name))
        .args(args)
        .env("OUTBOXD_BROKER_JVM_OPTS", "")
        .output()?;
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
    Ok(crate::ports::free_port()?)
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

    /// CPU seconds the PostgreSQL server and the broker have used so far (see [`SystemCpu`]). A server
    /// process that has exited but was not reaped yet counts nowhere, nor does one reaped while the others
    /// are read: this reads again (for up to a second) until neither happened.
    pub fn system_cpu(&self) -> BenchResult<SystemCpu> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let (cpu, exiting) = self.system_cpu_once()?;
            if !exiting || Instant::now() > deadline {
                return Ok(cpu);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// [`Stack::system_cpu`], and whether a server process was exiting (a zombie) or reaped meanwhile.
    fn system_cpu_once(&self) -> BenchResult<(SystemCpu, bool)> {
        let postmaster_pid = std::fs::read_to_string(self.dir.join("pg/data/postmaster.pid"))?;
        let postmaster: u32 = postmaster_pid
            .lines()
            .next()
            .and_then(|line| line.trim().parse().ok())
            .ok_or("no pid in postmaster.pid")?;
        let reaped_before = proc_times(postmaster)?.with_reaped_children();
        let mut postgres = reaped_before;
        let mut exiting = false;
        for entry in std::fs::read_dir("/proc")? {
            let Some(pid) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            // A process may exit between the listing and the read: it is counted as reaped, or not yet.
            if let Ok(times) = proc_times(pid) {
                if times.parent == postmaster {
                    postgres += times.own;
                    exiting |= times.zombie;
                }
            }
        }
        let broker_pid = ["broker/kafka.pid", "broker/tansu.pid"]
            .iter()
            .find_map(|file| std::fs::read_to_string(self.dir.join(file)).ok())
            .and_then(|pid| pid.trim().parse().ok())
            .ok_or("no broker pid file")?;
        let cpu = SystemCpu {
            postgres,
            broker: proc_times(broker_pid)?.own,
        };
        // A child reaped while the others were read is in neither sum: read again.
        let reaped_meanwhile = proc_times(postmaster)?.with_reaped_children() != reaped_before;
        Ok((cpu, exiting || reaped_meanwhile))
    }
}

/// CPU seconds used so far by the PostgreSQL server (the postmaster, every process under it, and those that
/// exited: a reaped child's time is added to its parent's) and by the broker process (all threads).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemCpu {
    pub postgres: f64,
    pub broker: f64,
}

impl std::ops::Sub for SystemCpu {
    type Output = SystemCpu;
    fn sub(self, before: SystemCpu) -> SystemCpu {
        SystemCpu {
            postgres: self.postgres - before.postgres,
            broker: self.broker - before.broker,
        }
    }
}

/// A process's parent and CPU seconds, its own (every thread) and its reaped children's.
struct ProcTimes {
    zombie: bool,
    parent: u32,
    own: f64,
    children: f64,
}

impl ProcTimes {
    fn with_reaped_children(&self) -> f64 {
        self.own + self.children
    }
}

/// Fields of /proc/PID/stat: state, ppid, utime + stime, cutime + cstime.
fn proc_times(pid: u32) -> BenchResult<ProcTimes> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest)
        .ok_or("unexpected /proc stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> BenchResult<f64> {
        Ok(fields.get(i).ok_or("short /proc stat")?.parse::<f64>()?)
    };
    let ticks = clock_ticks_per_second();
    Ok(ProcTimes {
        zombie: fields.first() == Some(&"Z"),
        parent: field(1)? as u32,
        own: (field(11)? + field(12)?) / ticks,
        children: (field(13)? + field(14)?) / ticks,
    })
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

    /// SIGKILL (a crash, an OOM kill), and wait until it is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait (SIGKILL after 30 s); nothing when it has exited already.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
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
    let cpu_seconds = proc_times(pid)?.own;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let peak_rss_kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or("no VmHWM")?;
    Ok(Usage {
        cpu_seconds,
        peak_rss_kib,
    })
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
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
