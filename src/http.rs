//! The HTTP endpoints: `/metrics` (Prometheus text), `/healthz` (the process is alive) and `/readyz`
//! (connected to PostgreSQL and the broker, and a pipeline is active; 503 with a JSON reason otherwise).
//! Owns the listener, its limits (connections, header time, request size, connection lifetime: whoever
//! reaches the port cannot exhaust memory or file descriptors) and the readiness flags; what sets the flags
//! is `stats` and the pipelines.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::error::{Error, Result};

/// What `/readyz` reports. Process-wide, like the metrics recorder.
pub struct Readiness {
    database: AtomicBool,
    broker: AtomicBool,
    /// Set while the task that refreshes `database` and `broker` is down (it failed): they are stale.
    checks_down: AtomicBool,
    /// 0 starting, 1 cdc, 2 poll, 3 standby, 4 reconnecting.
    mode: AtomicU8,
    /// Poll workers whose session ended and is being retried (one table's worker may be down while the
    /// others claim: the mode alone would say whichever spoke last).
    workers_reconnecting: AtomicUsize,
    /// Set while events wait and none has been delivered for a while (the watchdog in `stats` judges it).
    stalled: AtomicBool,
}

/// The process's readiness, set by `stats` and the pipelines, read by `/readyz`.
pub static READINESS: Readiness = Readiness::new();

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// Starting: nothing checked yet.
    pub const fn new() -> Self {
        Readiness {
            database: AtomicBool::new(false),
            broker: AtomicBool::new(false),
            checks_down: AtomicBool::new(false),
            mode: AtomicU8::new(0),
            workers_reconnecting: AtomicUsize::new(0),
            stalled: AtomicBool::new(false),
        }
    }

    /// Records the watchdog's judgement: events are due and none was published for a while.
    pub fn set_stalled(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::Relaxed);
    }

    /// True while the instance should be delivering: a pipeline streams or claims (it is not starting,
    /// standing by or reconnecting).
    pub fn should_deliver(&self) -> bool {
        matches!(self.mode.load(Ordering::Relaxed), 1 | 2)
            && self.workers_reconnecting.load(Ordering::Relaxed) == 0
    }

    /// Records whether the last check reached PostgreSQL.
    pub fn set_database(&self, ok: bool) {
        self.database.store(ok, Ordering::Relaxed);
    }

    /// Records whether the last check reached a broker.
    pub fn set_broker(&self, ok: bool) {
        self.broker.store(ok, Ordering::Relaxed);
    }

    /// Records whether the task that checks the database and the broker runs (`false` after it failed, until
    /// it runs again): their last answers are not trusted meanwhile.
    pub fn set_checks_running(&self, running: bool) {
        self.checks_down.store(!running, Ordering::Relaxed);
    }

    /// Records the active pipeline (`cdc` or `poll`), `standby`, or `reconnecting` (the pipeline's session
    /// ended and is being retried) for `/readyz` and `outboxd_mode`.
    pub fn set_mode(&self, mode: &str) {
        let code = match mode {
            "cdc" => 1,
            "poll" => 2,
            "standby" => 3,
            "reconnecting" => 4,
            _ => 0,
        };
        self.mode.store(code, Ordering::Relaxed);
        crate::metrics::set_mode(mode);
    }

    /// True while another instance is active for this slot and this one waits to take over.
    pub fn is_standby(&self) -> bool {
        self.mode.load(Ordering::Relaxed) == 3
    }

    /// `Ok(mode)` when ready, else the reason.
    pub fn check(&self) -> std::result::Result<&'static str, &'static str> {
        if self.checks_down.load(Ordering::Relaxed) {
            return Err("the readiness checks failed (see the log) and are starting again");
        }
        if !self.database.load(Ordering::Relaxed) {
            return Err("PostgreSQL is unreachable");
        }
        if !self.broker.load(Ordering::Relaxed) {
            return Err("no Kafka broker answers");
        }
        let mode = match self.mode.load(Ordering::Relaxed) {
            1 => "cdc",
            2 => "poll",
            3 => return Err("standby: another outboxd instance is active for this slot"),
            4 => return Err(RECONNECTING),
            _ => return Err("starting: no pipeline is active yet"),
        };
        if self.workers_reconnecting.load(Ordering::Relaxed) > 0 {
            return Err(RECONNECTING);
        }
        if self.stalled.load(Ordering::Relaxed) {
            return Err("stalled: events wait and none has been delivered for over a minute (a lock held on the outbox table, a broker that refuses them, or a slow server: see the log)");
        }
        Ok(mode)
    }
}

const RECONNECTING: &str =
    "reconnecting: the pipeline's database session ended and is being retried (see the log)";

/// One poll worker's part in readiness: down while its session is being retried. Dropping it (the worker
/// ended) takes its part back.
#[derive(Default)]
pub struct WorkerReadiness {
    reconnecting: bool,
}

impl WorkerReadiness {
    /// The worker's session ended and is being retried.
    pub fn reconnecting(&mut self) {
        if !self.reconnecting {
            self.reconnecting = true;
            READINESS
                .workers_reconnecting
                .fetch_add(1, Ordering::Relaxed);
            crate::metrics::set_mode("reconnecting");
        }
    }

    /// The worker claims again.
    pub fn working(&mut self, mode: &str) {
        if self.reconnecting {
            self.reconnecting = false;
            if READINESS
                .workers_reconnecting
                .fetch_sub(1, Ordering::Relaxed)
                == 1
            {
                READINESS.set_mode(mode);
            }
        }
    }
}

impl Drop for WorkerReadiness {
    fn drop(&mut self) {
        if self.reconnecting {
            READINESS
                .workers_reconnecting
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// At most this many connections at once (each costs a file descriptor, which the pipelines need). A new
/// connection beyond them closes the oldest: whoever holds connections open (kept alive with a request now
/// and then) cannot keep a probe or a scraper out, which needs one for a few milliseconds.
const MAX_CONNECTIONS: usize = 128;
/// A request's headers must arrive within this (slow-header clients hold nothing longer).
const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// A connection is closed after this, whatever it does (a scraper opens a new one).
const CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(60);
/// The most a connection may buffer of a request: three GET routes need little.
const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// Binds `addr` now (so a port in use is a start-up error naming the flag) and serves in the background.
pub async fn serve(addr: SocketAddr, metrics: PrometheusHandle) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::setup(
            format!("cannot listen on --metrics-addr {addr}: {e}"),
            "choose a free address with --metrics-addr, or turn the endpoint off with --metrics-addr off",
        )
    })?;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz));
    tokio::spawn(accept(listener, app));
    Ok(())
}

/// Serves each connection on a task of its own, within the limits above.
async fn accept(listener: tokio::net::TcpListener, app: axum::Router) {
    // The tasks serving connections, oldest first.
    let mut open: std::collections::VecDeque<tokio::task::JoinHandle<()>> = Default::default();
    let mut last_told: Option<tokio::time::Instant> = None;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, or a connection reset before it was accepted: try again soon.
                tracing::debug!(%error, "the metrics endpoint could not accept a connection");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        open.retain(|task| !task.is_finished());
        if open.len() >= MAX_CONNECTIONS {
            if let Some(oldest) = open.pop_front() {
                oldest.abort();
                // An aborted task keeps its connection (and file descriptor) until the runtime drops it,
                // which a flood of accepts can put off indefinitely: wait until it is gone, so the limit
                // holds for files too, not only for tasks.
                let _ = oldest.await;
            }
            // Said at most once a minute: under a flood this would be every connection.
            if last_told.is_none_or(|at| at.elapsed() > std::time::Duration::from_secs(60)) {
                last_told = Some(tokio::time::Instant::now());
                tracing::warn!(
                    limit = MAX_CONNECTIONS,
                    "the metrics endpoint has as many connections as it takes; closing the oldest for each new one"
                );
            }
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let task = tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .max_buf_size(MAX_REQUEST_BYTES)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
        });
        open.push_back(task);
    }
}

async fn readyz() -> impl IntoResponse {
    match READINESS.check() {
        Ok(mode) => (
            StatusCode::OK,
            format!("{{\"status\":\"ready\",\"mode\":\"{mode}\"}}\n"),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{{\"status\":\"not ready\",\"reason\":\"{reason}\"}}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{Readiness, WorkerReadiness};

    #[test]
    fn stale_checks_are_never_read_as_ready() {
        let readiness = Readiness::new();
        readiness.set_database(true);
        readiness.set_broker(true);
        readiness.set_mode("cdc");
        assert_eq!(readiness.check(), Ok("cdc"));
        readiness.set_checks_running(false);
        let reason = readiness.check().unwrap_err();
        assert!(reason.contains("checks failed"), "{reason}");
        readiness.set_checks_running(true);
        assert_eq!(readiness.check(), Ok("cdc"));
        readiness.set_database(false);
        assert_eq!(readiness.check(), Err("PostgreSQL is unreachable"));
    }

    /// One poll worker reconnecting makes the instance not ready, whatever the others say after it.
    #[test]
    fn one_reconnecting_worker_of_several_is_not_hidden_by_the_others() {
        let readiness = &super::READINESS;
        readiness.set_database(true);
        readiness.set_broker(true);
        readiness.set_mode("poll");
        let (mut first, mut second) = (WorkerReadiness::default(), WorkerReadiness::default());
        first.reconnecting();
        second.working("poll");
        assert_eq!(readiness.check(), Err(super::RECONNECTING));
        second.reconnecting();
        first.working("poll");
        assert_eq!(readiness.check(), Err(super::RECONNECTING));
        drop(second); // its worker ended
        assert_eq!(readiness.check(), Ok("poll"));
        readiness.set_stalled(true);
        assert!(readiness.check().unwrap_err().starts_with("stalled"));
        readiness.set_stalled(false);
    }
}
