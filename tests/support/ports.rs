//! Ports for the servers the tests and the benchmark start (`src/bin/outboxd-bench` includes this file too).
//! Taken from 20000..32768, below Linux's ephemeral range (32768..61000): a port the kernel hands out (bind
//! to port 0) is also the source port of the next outgoing connection, and with several tests at once a
//! broker or PostgreSQL started a moment later found it taken. Each call of a process moves on to the next
//! port, so two of its servers never get the same one; `kafka.sh` takes its controller ports from 10000..20000.

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};

const FIRST: u32 = 20_000;
const COUNT: u32 = 12_768;

/// A port nothing on 127.0.0.1 holds at the moment of the call.
pub fn free_port() -> std::io::Result<u16> {
    static NEXT: AtomicUsize = AtomicUsize::new(usize::MAX);
    // Processes start at different places, so two of them at once rarely race for a port.
    let start = std::process::id().wrapping_mul(7_919) % COUNT;
    let _ = NEXT.compare_exchange(
        usize::MAX,
        start as usize,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..COUNT {
        let n = NEXT.fetch_add(1, Ordering::SeqCst) as u32;
        let port = (FIRST + n % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrNotAvailable,
        format!("no free port on 127.0.0.1 in {FIRST}..{}", FIRST + COUNT),
    ))
}
