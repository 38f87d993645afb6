//! `outboxd migrate` on large, live tables: the application keeps inserting (with its own `lock_timeout`) and
//! never fails; indexes are built concurrently and never twice; an index already in place is kept; a table's
//! history counts as published unless the user says otherwise. Against a real PostgreSQL 15.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::*;

const USER_TABLE: &str = "CREATE TABLE public.outbox_event (
    event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";

/// An application session that inserts one event per transaction, as an order service does, with
/// `lock_timeout = '1s'`, until stopped. Counts commits and failures.
struct Application {
    stop: Arc<AtomicBool>,
    committed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Application {
    async fn start(pg: &Postgres) -> Self {
        let client = pg.client().await;
        client
            .batch_execute("SET lock_timeout = '1s'")
            .await
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicUsize::new(0));
        let (stop_, committed_) = (stop.clone(), committed.clone());
        let task = tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop_.load(Ordering::Relaxed) {
                let result = client
                    .execute(
                        "INSERT INTO public.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                         VALUES (gen_random_uuid(), 'Order', 'live', 'E', '{}')",
                        &[],
                    )
                    .await;
                match result {
                    Ok(_) => {
                        committed_.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => failures.push(format!("{error:?}")),
                }
            }
            failures
        });
        Application {
            stop,
            committed,
            task,
        }
    }

    async fn wait_more(&self, more: usize) {
        let target = self.committed.load(Ordering::Relaxed) + more;
        wait_for("the application to insert", Duration::from_secs(60), || {
            (self.committed.load(Ordering::Relaxed) >= target).then_some(())
        });
    }

    /// Stops it; returns (committed, failures).
    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let failures = self.task.await.unwrap();
        (self.committed.load(Ordering::Relaxed), failures)
    }
}

async fn invalid_indexes(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM pg_index WHERE indrelid = 'public.outbox_event'::regclass AND NOT indisvalid",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn claim_index(client: &tokio_postgres::Client) -> (u32, String) {
    let row = client
        .query_one(
            "SELECT 'public.outbox_event_claim_idx'::regclass::oid, pg_get_indexdef('public.outbox_event_claim_idx'::regclass)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Every migration, `--add-polling-columns` on a 5-million-row table, while the application inserts with
/// `lock_timeout = '1s'`. The old migrations held ACCESS EXCLUSIVE through every index build (seconds on this
/// table), so the application's inserts timed out.
#[tokio::test(flavor = "multi_thread")]
async fn migrations_on_a_live_five_million_row_table_never_fail_an_application_insert() {
    const ROWS: i64 = 5_000_000;
    let pg = Postgres::start();
    let url = pg.url();
    let client = pg.client().await;
    client.batch_execute(USER_TABLE).await.unwrap();
    client
        .execute(
            "INSERT INTO public.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT gen_random_uuid(), 'Order', 'order-' || (i % 100000), 'E', '{}',
                    now() - interval '1 day' + i * interval '1 millisecond'
             FROM generate_series(1, $1::int8) AS i",
            &[&ROWS],
        )
        .await
        .unwrap();
    client
        .batch_execute("ANALYZE public.outbox_event")
        .await
        .unwrap();

    let application = Application::start(&pg).await;
    application.wait_more(100).await;
    let url_ = url.clone();
    let migrated = tokio::task::spawn_blocking(move || {
        migrate_with(&url_, &["--add-polling-columns", "--poll-notify"])
    });
    let log = migrated.await.unwrap();
    application.wait_more(100).await;
    let (committed, failures) = application.stop().await;
    println!("the application committed {committed} inserts during the migration");
    assert!(
        failures.is_empty(),
        "{} application inserts failed during migrate, first: {}\n{log}",
        failures.len(),
        failures[0]
    );
    assert_eq!(invalid_indexes(&client).await, 0);
    let (_, definition) = claim_index(&client).await;
    assert!(definition.contains("NULLS FIRST"), "{definition}");
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE published_at = '-infinity'), count(*) FILTER (WHERE published_at IS NULL)
             FROM public.outbox_event",
            &[],
        )
        .await
        .unwrap();
    let (history, unpublished): (i64, i64) = (row.get(0), row.get(1));
    assert!(
        history >= ROWS,
        "the table's history counts as published before outboxd: {history}"
    );
    assert!(
        unpublished > 0 && unpublished as usize <= committed,
        "rows inserted after the migration are unpublished: {unpublished} of {committed}"
    );
}

/// Upgrading from a version whose 0002 built the claim index NULLS LAST replaces it (concurrently, under the
/// same name); an index already in the right order, pre-built by the user, is kept, not dropped and rebuilt.
#[tokio::test(flavor = "multi_thread")]
async fn the_claim_index_is_replaced_only_when_it_is_in_the_old_order() {
    let pg = Postgres::start();
    let url = pg.url();
    let client = pg.client().await;
    migrate_with(&url, &[]);
    let forget_claim_order = || async {
        client
            .execute(
                "DELETE FROM public.outboxd_migrations WHERE version >= 4",
                &[],
            )
            .await
            .unwrap();
    };
    // The user pre-built the index (as README shows), then migrates.
    client
        .batch_execute(
            "DROP INDEX public.outbox_event_claim_idx;
             CREATE INDEX outbox_event_claim_idx ON public.outbox_event (position NULLS FIRST, created_at, event_id)
                 WITH (fillfactor = 80) WHERE published_at IS NULL AND dead_at IS NULL",
        )
        .await
        .unwrap();
    forget_claim_order().await;
    let (prebuilt, _) = claim_index(&client).await;
    migrate_with(&url, &[]);
    let (kept, definition) = claim_index(&client).await;
    assert_eq!(
        kept, prebuilt,
        "the pre-built index was dropped: {definition}"
    );
    // An index of the old order is replaced.
    client
        .batch_execute(
            "DROP INDEX public.outbox_event_claim_idx;
             CREATE INDEX outbox_event_claim_idx ON public.outbox_event (position, created_at, event_id)
                 WHERE published_at IS NULL AND dead_at IS NULL",
        )
        .await
        .unwrap();
    forget_claim_order().await;
    migrate_with(&url, &[]);
    let (_, definition) = claim_index(&client).await;
    assert!(definition.contains("NULLS FIRST"), "{definition}");
    assert_eq!(invalid_indexes(&client).await, 0);
    // An interrupted concurrent build left an invalid index: it is built again.
    client
        .batch_execute(
            "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'public.outbox_event_dead_idx'::regclass",
        )
        .await
        .unwrap();
    client
        .execute(
            "DELETE FROM public.outboxd_migrations WHERE version = 5",
            &[],
        )
        .await
        .unwrap();
    migrate_with(&url, &[]);
    assert_eq!(invalid_indexes(&client).await, 0);
}

/// `--add-polling-columns` on a table whose history was already sent: by default that history counts as
/// published (it was all republished, ahead of live events, and counted as backlog forever);
/// `--existing-rows unpublished` publishes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_tables_history_counts_as_published_unless_asked_otherwise() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client.batch_execute(USER_TABLE).await.unwrap();
    let (history, _) = insert_events(&mut client, 0, 10, 5, 5, None).await;
    migrate_with(&url, &["--add-polling-columns"]);
    let status = run_outboxd(&["status", "--database-url", &url]);
    let status_text = String::from_utf8_lossy(&status.stdout).to_string();
    let backlog = status_text
        .lines()
        .find(|line| line.starts_with("unpublished events"))
        .and_then(|line| line.split_whitespace().last());
    assert_eq!(
        backlog,
        Some("0"),
        "the history is no backlog:\n{status_text}{}",
        stderr_of(&status)
    );
    let mut run = run_args(&url, &brokers);
    run.extend(["--mode", "poll"]);
    let _outboxd = Outboxd::spawn(&run);
    let (live, _) = insert_events(&mut client, 10, 4, 5, 5, None).await;
    wait_for_async("live events published", Duration::from_secs(60), || async {
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM public.outbox_event WHERE published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n == 0).then_some(())
    })
    .await;
    let records = consume_all(&brokers, &[TOPIC], live.len(), Duration::from_secs(60));
    let history_ids: std::collections::HashSet<String> =
        history.iter().map(|e| e.event_id.to_string()).collect();
    assert!(
        records
            .iter()
            .all(|r| !history_ids.contains(&r.headers["event_id"])),
        "the table's history was republished"
    );
    assert_eq!(records.len(), live.len());

    // Asked otherwise: a second table's history is published.
    client
        .batch_execute(&USER_TABLE.replace("outbox_event", "older_outbox"))
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO public.older_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'a', 'E', '{}' FROM generate_series(1, 10)",
        )
        .await
        .unwrap();
    migrate_with(
        &url,
        &[
            "--table",
            "public.older_outbox",
            "--publication",
            "older",
            "--add-polling-columns",
            "--existing-rows",
            "unpublished",
        ],
    );
    // Handed to the polling path at once: published next to a slot that streamed past them long ago too.
    let handed_off: i64 = client
        .query_one(
            "SELECT count(*) FROM public.older_outbox WHERE published_at IS NULL AND handoff_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(handed_off, 10);
}

/// PostgreSQL builds no index of a partitioned table concurrently: migrate builds each partition's
/// concurrently and attaches it, so the parent's index ends valid, on every partition.
#[tokio::test(flavor = "multi_thread")]
async fn indexes_of_a_partitioned_table_are_built_partition_by_partition() {
    let pg = Postgres::start();
    let url = pg.url();
    let client = pg.client().await;
    client.batch_execute(PARTITIONED_TABLE).await.unwrap();
    migrate_with(&url, &["--table", "outbox_p", "--add-polling-columns"]);
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE NOT x.indisvalid),
                    count(*) FILTER (WHERE c.relname LIKE '%claim_idx%' AND x.indrelid <> 'public.outbox_p'::regclass)
             FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
             WHERE x.indrelid IN ('public.outbox_p'::regclass, 'public.outbox_p_2020'::regclass, 'public.outbox_p_now'::regclass)",
            &[],
        )
        .await
        .unwrap();
    let (invalid, partition_claim_indexes): (i64, i64) = (row.get(0), row.get(1));
    assert_eq!(invalid, 0, "every index is valid");
    assert_eq!(
        partition_claim_indexes, 2,
        "each partition has the claim index"
    );
    // Idempotent.
    migrate_with(&url, &["--table", "outbox_p", "--add-polling-columns"]);
}

/// The user's table migrated with `migrate_args`; outboxd streamed 10 events of it and was killed, and 10
/// more were committed since: the slot owes them. Returns every committed event.
async fn rows_owed_by_a_killed_outboxd(
    migrate_args: &[&str],
) -> (Postgres, Broker, tokio_postgres::Client, Vec<Inserted>) {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client.batch_execute(USER_TABLE).await.unwrap();
    migrate_with(&url, migrate_args);
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let (mut committed, _) = insert_events(&mut client, 0, 2, 5, 5, None).await;
    consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    outboxd.kill();
    let (owed, _) = insert_events(&mut client, 2, 2, 5, 5, None).await;
    committed.extend(owed);
    (pg, broker, client, committed)
}

/// `--existing-rows published` while the slot has not streamed every row yet (outboxd stopped for the
/// upgrade), then the slot is lost before outboxd streams them: the rows it owed are handed to the polling path
/// (the '-infinity' mark used to leave them unpublished for good).
#[tokio::test(flavor = "multi_thread")]
async fn rows_a_lost_slot_owed_when_history_was_marked_are_still_published() {
    let (pg, broker, client, committed) = rows_owed_by_a_killed_outboxd(&[]).await;
    let (url, brokers) = (pg.url(), broker.addr());
    let log = migrate_with(&url, &["--add-polling-columns"]);
    assert!(log.contains("has not streamed all of them"), "{log}");
    // The slot is lost before outboxd runs again.
    lose_slot(&client, "outboxd").await;
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(90));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "rows the lost slot owed: {report:?}");
}

/// One migrate at a time, across versions: a migrate waits while another holds the migration lock, in
/// outboxd's keyspace or in the form earlier versions took it (a bigint), so that a migrate of an earlier
/// version (a rolling upgrade's init containers) never runs at the same time as this one.
#[tokio::test(flavor = "multi_thread")]
async fn a_migrate_waits_for_another_of_this_or_an_earlier_version() {
    let pg = Postgres::start();
    let url = pg.url();
    let class = outboxd::pipeline::liveness::OUTBOXD_LOCK_CLASS;
    for lock in [
        format!("pg_advisory_lock({class}, hashtext('outboxd.migrate'))"),
        format!("pg_advisory_lock({})", 0x6f75_7462_6f78_6d67_i64),
    ] {
        let holder = pg.client().await;
        holder
            .batch_execute(&format!("SELECT {lock}"))
            .await
            .unwrap();
        let mut migrate = Outboxd::spawn(&["migrate", "--database-url", &url]);
        wait_for(
            &format!("migrate to wait for the holder of {lock}"),
            Duration::from_secs(60),
            || {
                migrate
                    .log_text()
                    .contains("another outboxd migrate is running")
                    .then_some(())
            },
        );
        assert!(migrate.try_wait().is_none(), "migrate ran beside {lock}");
        drop(holder);
        assert!(migrate.wait_exit().success(), "{}", migrate.log_text());
    }
}

/// `outboxd migrate --add-polling-columns` while a CDC-only outboxd streams the table (review finding F5):
/// the rows inserted from then on must get `published_at` (the running outboxd had no statement to write
/// it, so they stayed unpublished forever: a backlog that never drains, republished by any later hand-off).
#[tokio::test(flavor = "multi_thread")]
async fn polling_columns_added_while_outboxd_streams_are_used_from_the_next_row_on() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client.batch_execute(USER_TABLE).await.unwrap();
    migrate_with(&url, &[]);
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let (mut committed, _) = insert_events(&mut client, 0, 4, 5, 5, None).await;
    let now = current_wal_lsn(&client).await;
    wait_confirmed_past(&client, "outboxd", now, "the CDC-only rows to be streamed").await;
    migrate_with(&url, &["--add-polling-columns"]);
    let (after, _) = insert_events(&mut client, 4, 20, 5, 5, None).await;
    committed.extend(after);
    // Every row inserted after the migration is marked published.
    wait_all_published(&client, Duration::from_secs(90)).await;
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0);
    assert_eq!(report.order_violations, 0);
    let log = outboxd.log_text();
    assert!(log.contains("gained the polling columns"), "{log}");
}

/// The slot that owed rows marked published before outboxd is replaced (a failover to a server without it, or
/// a drop) before it streamed them, and `outboxd migrate` runs again meanwhile (a deploy pipeline repeats it):
/// the new slot never sends those rows, so its creation must hand them to the polling path (review finding
/// F6; the adversarial review found the second migrate taking "no slot" for "owed by none").
#[tokio::test(flavor = "multi_thread")]
async fn rows_a_replaced_slot_owed_are_still_published_after_another_migrate() {
    let (pg, broker, client, committed) = rows_owed_by_a_killed_outboxd(&[]).await;
    let (url, brokers) = (pg.url(), broker.addr());
    let log = migrate_with(&url, &["--add-polling-columns"]);
    assert!(log.contains("has not streamed all of them"), "{log}");
    // The slot goes (a failover to a standby without it, or a drop), and migrate runs again.
    wait_for_async(
        "the killed walsender to let go",
        Duration::from_secs(30),
        || async {
            client
                .execute("SELECT pg_drop_replication_slot('outboxd')", &[])
                .await
                .ok()
        },
    )
    .await;
    migrate_with(&url, &[]);
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(90));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "rows the replaced slot owed: {report:?}");
}

/// The polling columns are dropped (a rolled-back migration) while the slot still owes rows inserted before:
/// the stream describes those rows with the columns the table no longer has. outboxd must stream on without
/// them (fresh adversarial review, finding 9: it took them for columns gained and started its pipeline over
/// and over, publishing nothing).
#[tokio::test(flavor = "multi_thread")]
async fn rows_streamed_with_columns_since_dropped_are_published() {
    // The rows the slot owes are described by the stream with the polling columns.
    let (pg, broker, mut client, mut committed) =
        rows_owed_by_a_killed_outboxd(&["--add-polling-columns"]).await;
    let (url, brokers) = (pg.url(), broker.addr());
    client
        .batch_execute(
            "ALTER TABLE public.outbox_event DROP COLUMN available_at, DROP COLUMN attempts,
                 DROP COLUMN lease_token, DROP COLUMN lease_until, DROP COLUMN published_at,
                 DROP COLUMN last_error, DROP COLUMN dead_at, DROP COLUMN handoff_at,
                 DROP COLUMN position CASCADE",
        )
        .await
        .unwrap();
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let (after, _) = insert_events(&mut client, 4, 2, 5, 5, None).await;
    committed.extend(after);
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(90));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "{report:?}\n{}", outboxd.log_text());
    assert_eq!(report.order_violations, 0, "{report:?}");
}

/// An application inserting as its own role, with INSERT on the table and nothing else (an outside review's
/// finding): PostgreSQL runs `position`'s default, `nextval`, with the inserting role's rights, so from the
/// moment `migrate --add-polling-columns` set it every insert failed ("permission denied for sequence").
/// migrate grants USAGE to every role that may insert (directly, through a group, column by column) in the
/// step that sets the default; a role granted INSERT later gets it from the next migrate.
#[tokio::test(flavor = "multi_thread")]
async fn roles_that_may_insert_keep_inserting_after_migrate() {
    let pg = Postgres::start();
    let url = pg.url();
    let client = pg.client().await;
    client
        .batch_execute(&format!(
            "{USER_TABLE};
             CREATE ROLE app LOGIN; CREATE ROLE writers; CREATE ROLE service LOGIN IN ROLE writers;
             CREATE ROLE narrow LOGIN;
             GRANT INSERT ON public.outbox_event TO app, writers;
             GRANT INSERT (event_id, aggregate_type, aggregate_id, event_type, payload) ON public.outbox_event TO narrow;"
        ))
        .await
        .unwrap();
    let insert_as = |role: &'static str| {
        let pg = &pg;
        async move {
            pg.client_as(role)
                .await
                .execute(
                    "INSERT INTO public.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES (gen_random_uuid(), 'Order', 'o-1', 'E', '{}')",
                    &[],
                )
                .await
                .map_err(|e| format!("{role}: {e:?}"))
        }
    };
    for role in ["app", "service", "narrow"] {
        insert_as(role).await.unwrap();
    }
    migrate_with(&url, &["--add-polling-columns"]);
    for role in ["app", "service", "narrow"] {
        insert_as(role).await.unwrap();
    }
    client
        .batch_execute("CREATE ROLE late LOGIN; GRANT INSERT ON public.outbox_event TO late")
        .await
        .unwrap();
    let refused = insert_as("late").await.unwrap_err();
    assert!(
        refused.contains("permission denied for sequence"),
        "{refused}"
    );
    migrate_with(&url, &[]);
    insert_as("late").await.unwrap();
}
