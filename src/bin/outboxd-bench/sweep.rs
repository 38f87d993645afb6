//! The sweep: how the whole system's cost per event grows along one axis at a time (payload size,
//! aggregates, events per transaction, backlog, outbox tables), every point a CDC drain of a backlog of that
//! shape ([`Bench::shaped_drain`]), and its report: a text chart per axis and a CSV file. Running the
//! drains is `scenarios`' job; this module only chooses the points and draws them.

use std::fmt::Write as _;

use crate::scenarios::{Bench, Drain, Shape};
use crate::stack::BenchResult;

/// One dimension of a backlog's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    PayloadBytes,
    Aggregates,
    EventsPerTransaction,
    Backlog,
    Tables,
}

impl Axis {
    pub const ALL: [Axis; 5] = [
        Axis::PayloadBytes,
        Axis::Aggregates,
        Axis::EventsPerTransaction,
        Axis::Backlog,
        Axis::Tables,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Axis::PayloadBytes => "payload bytes",
            Axis::Aggregates => "aggregates",
            Axis::EventsPerTransaction => "events per transaction",
            Axis::Backlog => "backlog (events)",
            Axis::Tables => "outbox tables",
        }
    }

    /// The values swept (`quick`: two small ones, for the smoke run).
    pub fn values(self, quick: bool) -> Vec<usize> {
        match (self, quick) {
            (Axis::PayloadBytes, false) => vec![100, 1_024, 8_192, 65_536],
            (Axis::PayloadBytes, true) => vec![100, 8_192],
            (Axis::Aggregates, false) => vec![10, 1_000, 100_000, 1_000_000],
            (Axis::Aggregates, true) => vec![10, 10_000],
            (Axis::EventsPerTransaction, false) => vec![1, 10, 100, 1_000, 10_000],
            (Axis::EventsPerTransaction, true) => vec![1, 1_000],
            (Axis::Backlog, false) => vec![10_000, 100_000, 1_000_000, 5_000_000],
            (Axis::Backlog, true) => vec![1_000, 10_000],
            (Axis::Tables, false) => vec![1, 2, 4, 8],
            (Axis::Tables, true) => vec![1, 2],
        }
    }

    /// The baseline shape of `events` with this axis at `value`. Large payloads get fewer events, so a
    /// point's payloads stay within 512 MiB.
    pub fn shape(self, value: usize, events: usize) -> Shape {
        let mut shape = Shape::baseline(events);
        match self {
            Axis::PayloadBytes => {
                shape.payload_bytes = value;
                shape.events = events.min(MAX_PAYLOAD_PER_POINT / value.max(1));
            }
            Axis::Aggregates => shape.aggregates = value,
            Axis::EventsPerTransaction => shape.events_per_txn = value,
            Axis::Backlog => shape.events = value,
            Axis::Tables => shape.tables = value,
        }
        shape
    }
}

const MAX_PAYLOAD_PER_POINT: usize = 512 << 20;

/// One point of an axis: its value and the drain there.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    pub value: usize,
    pub drain: Drain,
}

/// Every axis in turn, `events` per point (the backlog axis excepted); the outbox table alone in the
/// publication again at the end.
pub async fn run(
    bench: &Bench,
    events: usize,
    quick: bool,
) -> BenchResult<Vec<(Axis, Vec<Point>)>> {
    let mut axes = Vec::new();
    for axis in Axis::ALL {
        let mut points = Vec::new();
        for value in axis.values(quick) {
            let shape = axis.shape(value, events);
            eprintln!(
                "sweep: {} {value} ({} events) ...",
                axis.name(),
                shape.events
            );
            points.push(Point {
                value,
                drain: bench.shaped_drain(&shape).await?,
            });
        }
        axes.push((axis, points));
    }
    bench.reset().await?;
    bench.publish_tables(&["outbox_event"]).await?;
    Ok(axes)
}

/// Bar width of the costliest point of an axis, in characters.
const CHART_WIDTH: usize = 48;

/// A text chart of one axis: per point a bar of the whole system's CPU µs per event, split into outboxd
/// (`o`), PostgreSQL (`p`) and the broker (`k`), scaled to the axis' costliest point; then the figures.
pub fn chart(axis: Axis, points: &[Point]) -> String {
    let most = points
        .iter()
        .map(|point| point.drain.per_event().total_cpu())
        .fold(0.0_f64, f64::max);
    let scale = if most > 0.0 {
        CHART_WIDTH as f64 / most
    } else {
        0.0
    };
    let mut chart = format!(
        "{}: CPU µs per event (o outboxd, p PostgreSQL, k broker) | events/s | WAL bytes/event | outboxd peak RSS MiB\n",
        axis.name()
    );
    for point in points {
        let cost = point.drain.per_event();
        // Each part rounded on its own; their sum stays within a character or two of the total's bar.
        let bar: String = [
            ('o', cost.client_cpu),
            ('p', cost.postgres_cpu),
            ('k', cost.broker_cpu),
        ]
        .iter()
        .map(|&(mark, micros)| mark.to_string().repeat((micros * scale).round() as usize))
        .collect();
        let _ = writeln!(
            chart,
            "{:>9} |{bar:<width$} {:>7.1} | {:>7.0}/s | {:>7.0} | {:>5.1}",
            point.value,
            cost.total_cpu(),
            point.drain.rate(),
            cost.wal_bytes,
            point.drain.usage.peak_rss_kib as f64 / 1024.0,
            width = CHART_WIDTH + 2,
        );
    }
    chart
}

/// One line per point (`sweep.csv`).
pub fn csv(axes: &[(Axis, Vec<Point>)]) -> String {
    let mut csv = String::from(
        "axis,value,events,seconds,streaming_seconds,start_up_seconds,end_seconds,outboxd_cpu_us,postgres_cpu_us,broker_cpu_us,total_cpu_us,wal_bytes,peak_rss_kib\n",
    );
    for (axis, points) in axes {
        for point in points {
            let (drain, cost) = (point.drain, point.drain.per_event());
            let _ = writeln!(
                csv,
                "{},{},{},{:.3},{:.3},{:.3},{:.3},{:.2},{:.2},{:.2},{:.2},{:.0},{}",
                axis.name(),
                point.value,
                drain.events,
                drain.seconds,
                drain.streaming_seconds,
                drain.first_published_after,
                drain.tail_seconds(),
                cost.client_cpu,
                cost.postgres_cpu,
                cost.broker_cpu,
                cost.total_cpu(),
                cost.wal_bytes,
                drain.usage.peak_rss_kib
            );
        }
    }
    csv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_axis_changes_only_its_own_dimension_and_large_payloads_get_fewer_events() {
        let baseline = Shape::baseline(100_000);
        let shape = Axis::Tables.shape(8, 100_000);
        assert_eq!(shape.tables, 8);
        assert_eq!(shape.events, baseline.events);
        assert_eq!(shape.payload_bytes, baseline.payload_bytes);
        let big = Axis::PayloadBytes.shape(65_536, 100_000);
        assert_eq!(big.events, 8_192);
        assert_eq!(big.aggregates, baseline.aggregates);
        assert_eq!(Axis::Backlog.shape(5_000_000, 100_000).events, 5_000_000);
    }

    #[test]
    fn the_costliest_point_fills_the_chart() {
        let drain = |micros: f64| Drain {
            events: 1_000_000,
            seconds: 10.0,
            streaming_seconds: 9.0,
            first_published_after: 0.5,
            usage: crate::stack::Usage {
                cpu_seconds: micros,
                peak_rss_kib: 20_480,
            },
            system: crate::scenarios::SystemCost::default(),
        };
        let points = [
            Point {
                value: 1,
                drain: drain(10.0),
            },
            Point {
                value: 2,
                drain: drain(20.0),
            },
        ];
        let chart = chart(Axis::Tables, &points);
        let lines: Vec<&str> = chart.lines().collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[1].matches('o').count(), CHART_WIDTH / 2);
        assert_eq!(lines[2].matches('o').count(), CHART_WIDTH);
        assert!(lines[2].contains("20.0"), "{}", lines[2]);
    }
}
