//! The `outboxd` binary: parse options, set up logging, dispatch to migrate / run / status / doctor, and report
//! errors once, with their fix, at the edge.

use std::process::ExitCode;

use clap::Parser;
use outboxd::config::{Cli, Command, DeadCommand, LogFormat, Options};
use outboxd::pg::outbox::{DeadRange, ReplayFilter};
use outboxd::{config, logging, pg, pipeline, status};
use tokio::sync::watch;

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,rdkafka=warn,tokio_postgres=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours only on a terminal: a log file or collector gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.fmt_fields(logging::text_fields()).init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    // Before any thread starts, so that setting the environment is sound.
    let secrets = config::secret_files::resolve(
        |name| std::env::var(name).ok(),
        |path| std::fs::read_to_string(path),
    );
    match secrets {
        Ok(secrets) => secrets
            .into_iter()
            .for_each(|(name, value)| std::env::set_var(name, value)),
        Err(error) => {
            eprintln!("error: {}", logging::escape_controls(&error.to_string()));
            return ExitCode::from(2);
        }
    }
    let cli = Cli::parse();
    let options = match &cli.command {
        Command::Migrate(options) | Command::Run(options) => options.clone(),
        Command::Status { options, .. }
        | Command::Replay { options, .. }
        | Command::Doctor { options, .. }
        | Command::Audit { options, .. }
        | Command::Dead {
            command: DeadCommand::List { options, .. } | DeadCommand::Show { options, .. },
        } => options.clone(),
    };
    let options = match options.with_file() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("error: {}", logging::escape_controls(&error.to_string()));
            return ExitCode::from(2);
        }
    };
    init_tracing(options.log_format.unwrap_or_default());
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(dispatch(cli.command, options));
    match result {
        Ok(code) => code,
        Err(error) => {
            // Printed once, plainly, whatever the log format: this is the line a person acts on.
            eprintln!("error: {}", logging::escape_controls(&error.to_string()));
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command, options: Options) -> outboxd::Result<ExitCode> {
    match command {
        Command::Migrate(_) => migrate(&options).await,
        Command::Run(_) => run(&options).await,
        Command::Replay {
            event_id,
            aggregate_id,
            all_dead,
            published,
            aggregate_type,
            since,
            until,
            event_type,
            predicate,
            to_topic,
            rate,
            from_archive,
            resume,
            cancel,
            ..
        } => {
            if let Some(replay_id) = cancel {
                let let_go = outboxd::replay::cancel(options.database()?, &replay_id).await?;
                println!(
                    "replay {replay_id} cancelled: {let_go} held event(s) count as published again"
                );
                return Ok(ExitCode::SUCCESS);
            }
            if published || resume.is_some() {
                let plan = outboxd::replay::Plan {
                    since: optional_point_in_time("--since", since.as_deref())?,
                    until: optional_point_in_time("--until", until.as_deref())?,
                    aggregate_type,
                    aggregate_id,
                    event_type,
                    predicate,
                    to_topic,
                    rate,
                    from_archive,
                    pipeline: None,
                };
                return replay_published(&options, plan, published, resume, event_id, all_dead)
                    .await;
            }
            let time_travel_only = [
                ("--event-type", event_type.is_some()),
                ("--where", predicate.is_some()),
                ("--to-topic", to_topic.is_some()),
                ("--rate", rate.is_some()),
                ("--from-archive", from_archive.is_some()),
            ];
            if let Some((flag, _)) = time_travel_only.iter().find(|(_, given)| *given) {
                return Err(outboxd::config::ConfigError::Invalid(format!(
                    "{flag} selects events already published: add --published (dead events are replayed with --event-id, --aggregate-id or --all-dead)"
                ))
                .into());
            }
            let narrowed = [&aggregate_type, &since, &until]
                .iter()
                .any(|flag| flag.is_some());
            let filter = match (event_id, aggregate_id, all_dead) {
                (Some(_), _, _) if narrowed => Err(outboxd::config::ConfigError::Invalid(
                    "--aggregate-type, --since and --until narrow --all-dead or --aggregate-id, not --event-id".into(),
                )
                .into()),
                (Some(id), _, _) => Ok(ReplayFilter::EventId(id)),
                (None, aggregate_id, all_dead) if aggregate_id.is_some() || all_dead => {
                    dead_range(aggregate_id, aggregate_type, since, until).map(ReplayFilter::Dead)
                }
                _ => Err(outboxd::config::ConfigError::Invalid(
                    "replay needs one of --event-id ID, --aggregate-id ID or --all-dead (dead events), or --published (events already published)".into(),
                )
                .into()),
            };
            match filter {
                Ok(filter) => replay(&options, &filter).await,
                Err(error) => Err(error),
            }
        }
        Command::Status {
            json, thresholds, ..
        } => status(&options, json, &thresholds).await,
        Command::Doctor { json, .. } => doctor(&options, json).await,
        Command::Dead { command } => dead(&options, command).await,
        Command::Audit {
            since,
            until,
            aggregate_type,
            json,
            details,
            fail_on_duplicates,
            heal,
            ..
        } => {
            let range = outboxd::audit::Range {
                since: optional_point_in_time("--since", since.as_deref())?,
                until: optional_point_in_time("--until", until.as_deref())?,
                aggregate_type,
                heal,
                read_since: None,
            };
            audit(&options, &range, json, details, fail_on_duplicates).await
        }
    }
}

/// `--since` / `--until`: RFC 3339, or an age ("2h": two hours ago).
fn optional_point_in_time(
    flag: &str,
    value: Option<&str>,
) -> outboxd::Result<Option<std::time::SystemTime>> {
    value.map(|t| point_in_time(flag, t)).transpose()
}

fn point_in_time(flag: &str, value: &str) -> outboxd::Result<std::time::SystemTime> {
    if let Ok(at) = humantime::parse_rfc3339_weak(value) {
        return Ok(at);
    }
    match humantime::parse_duration(value) {
        Ok(age) => Ok(std::time::SystemTime::now() - age),
        Err(_) => Err(outboxd::config::ConfigError::Invalid(format!(
            "{flag} {value:?} is neither a time (2026-12-01T00:00:00Z) nor an age (2h, 7d)"
        ))
        .into()),
    }
}

/// `outboxd audit`: the summary (text or JSON), the findings to `--details`, the verdict's exit code.
async fn audit(
    options: &Options,
    range: &outboxd::audit::Range,
    json: bool,
    details: Option<std::path::PathBuf>,
    fail_on_duplicates: bool,
) -> outboxd::Result<ExitCode> {
    let settings = options.run()?;
    let mut file = match &details {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| {
                outboxd::Error::setup(
                    format!("cannot create the details file {}: {e}", path.display()),
                    "give --details a writable path",
                )
            })?,
        )),
        None => None,
    };
    let summary = outboxd::audit::audit(
        settings,
        range,
        file.as_mut().map(|f| f as &mut (dyn std::io::Write + Send)),
    )
    .await;
    if let Some(mut file) = file {
        use std::io::Write;
        file.flush().map_err(|e| {
            outboxd::Error::setup(
                format!("cannot write the details file: {e}"),
                "give --details a writable path",
            )
        })?;
    }
    let summary = match summary {
        Ok(summary) => summary,
        Err(error) => {
            eprintln!(
                "error: could not audit: {}",
                logging::escape_controls(&error.to_string())
            );
            return Ok(ExitCode::from(
                outboxd::audit::report::Verdict::CouldNotAudit as u8,
            ));
        }
    };
    let verdict = summary.verdict(fail_on_duplicates);
    if json {
        let mut value = serde_json::to_value(&summary).unwrap_or_default();
        if let Some(object) = value.as_object_mut() {
            object.insert("exit_code".into(), (verdict as u8).into());
        }
        println!("{value}");
    } else {
        print!("{}", summary.to_text(fail_on_duplicates));
    }
    Ok(ExitCode::from(verdict as u8))
}

/// `outboxd migrate`: the table's columns and indexes, the publication, the NOTIFY trigger when asked.
async fn migrate(options: &Options) -> outboxd::Result<ExitCode> {
    let settings = options.database()?;
    let mut client = pg::connect(&settings.database_url).await?;
    let report = pg::migrate::migrate(&mut client, &settings).await?;
    for table in &settings.tables {
        let trigger = pg::migrate::notify_trigger(&client, &table.name).await?;
        if options.poll_notify {
            pg::migrate::install_notify_trigger(&mut client, &table.name).await?;
            tracing::warn!(table = %table.name, "installed the LISTEN/NOTIFY trigger: every insert now notifies (serialising commits); drop it with DROP TRIGGER outboxd_notify ON <table>");
        } else if trigger == pg::migrate::NotifyTrigger::Outdated {
            // An older version's trigger: with a long table name it makes every insert fail.
            pg::migrate::install_notify_trigger(&mut client, &table.name).await?;
            tracing::info!(table = %table.name, "updated the LISTEN/NOTIFY trigger to this version's channel name");
        }
    }
    for (table, position, target) in &report.history_awaiting_slot {
        tracing::warn!(%table, slot = %settings.slot, %position, %target, "the table's rows now count as published before outboxd (--existing-rows published), but the slot has not streamed all of them yet: it still will, once outboxd runs; until its confirmed_flush_lsn passes the target (see `outboxd status`), keep the slot (should it be lost or replaced first, outboxd republishes the table's history), and run `outboxd migrate` again once it has: it records that no slot owes the history any longer (so that a slot created later, e.g. after a failover, does not republish it)");
    }
    for table in &report.cdc_only {
        tracing::warn!(%table, "existing table left without the polling columns: outboxd will run CDC only (no backfill of older rows, no polling fallback, no retries or dead letters); add them with `outboxd migrate --add-polling-columns`");
    }
    tracing::info!(applied = ?report.applied, publication_created = report.publication_created, tables = %outboxd::table::list(settings.tables.iter().map(|t| &t.name)), publication = %settings.publication, "migrations done");
    Ok(ExitCode::SUCCESS)
}

/// `outboxd run`: the pipeline until SIGINT/SIGTERM, with /metrics and the periodic figures.
async fn run(options: &Options) -> outboxd::Result<ExitCode> {
    let settings = options.run()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("received shutdown signal");
        let _ = stop_tx.send(true);
        // Keep the sender alive so receivers never see a closed channel.
        std::future::pending::<()>().await;
    });
    let metrics = outboxd::metrics::install()
        .map_err(|e| outboxd::Error::bug(format!("cannot set up metrics: {e}")))?;
    if let Some(addr) = settings.metrics_addr {
        outboxd::http::serve(addr, metrics).await?;
    }
    let shared = std::sync::Arc::new(settings.clone());
    tokio::spawn(outboxd::stats::run(shared.clone()));
    if settings.mode != outboxd::config::Mode::Poll {
        tokio::spawn(outboxd::stats::watch_failover(shared));
    }
    if let Some(every) = settings.audit_interval {
        tokio::spawn(outboxd::audit::continuous::run(settings.clone(), every));
    }
    pipeline::run(settings, stop_rx).await?;
    Ok(ExitCode::SUCCESS)
}

/// `outboxd replay`: re-queues dead-lettered events.
fn dead_range(
    aggregate_id: Option<String>,
    aggregate_type: Option<String>,
    since: Option<String>,
    until: Option<String>,
) -> outboxd::Result<DeadRange> {
    Ok(DeadRange {
        aggregate_id,
        aggregate_type,
        since: optional_point_in_time("--since", since.as_deref())?,
        until: optional_point_in_time("--until", until.as_deref())?,
    })
}

async fn replay(options: &Options, filter: &ReplayFilter) -> outboxd::Result<ExitCode> {
    let settings = options.database()?;
    let mut client = pg::connect(&settings.database_url).await?;
    let mut count = 0;
    for table in &pg::slot::inspect_all(&client, &settings.tables).await? {
        pg::slot::check_polling_columns(table)?;
        count += pg::outbox::replay_dead(&mut client, table, filter).await?;
    }
    println!("re-queued {count} dead event(s)");
    Ok(ExitCode::SUCCESS)
}

/// `outboxd replay --published` (or `--resume`): prints the replay's id first (for `--resume`), then what
/// it republished.
async fn replay_published(
    options: &Options,
    plan: outboxd::replay::Plan,
    published: bool,
    resume: Option<String>,
    event_id: Option<uuid::Uuid>,
    all_dead: bool,
) -> outboxd::Result<ExitCode> {
    let invalid = |message: &str| -> outboxd::Result<ExitCode> {
        Err(outboxd::config::ConfigError::Invalid(message.into()).into())
    };
    if event_id.is_some() || all_dead {
        return invalid("--event-id and --all-dead replay dead events; --published replays events already published: give one or the other");
    }
    if plan
        .rate
        .is_some_and(|rate| !(rate > 0.0 && rate.is_finite()))
    {
        return invalid("--rate must be a number of events per second above 0");
    }
    if plan.to_topic.as_deref().is_some_and(str::is_empty) {
        return invalid("--to-topic needs a topic name");
    }
    let plan = match (&resume, published) {
        (Some(_), true) => {
            return invalid("--resume goes on with a replay as it was started: give it without --published and the selection flags")
        }
        (Some(_), false) if plan != outboxd::replay::Plan::default() => {
            return invalid("--resume goes on with a replay as it was started: give it without the selection flags")
        }
        (Some(_), false) => None,
        (None, _) => Some(plan),
    };
    let database = options.database()?;
    // Kafka's settings only where the replay produces itself (to another topic), or may (a resumed one).
    let kafka = match &plan {
        Some(plan) if plan.to_topic.is_none() => None,
        Some(_) => Some(options.run()?),
        None => options.run().ok(),
    };
    let replay_id = match resume {
        Some(id) => id,
        None => {
            let id = outboxd::replay::new_replay_id(std::time::SystemTime::now());
            println!("replay {id} started (if it is interrupted: outboxd replay --resume {id})");
            id
        }
    };
    let pipeline = outboxd::replay::Pipeline {
        mode: options.mode.unwrap_or_default(),
        poll_order: options.poll_order.unwrap_or_default(),
        slot: database.slot.clone(),
    };
    let outcome = outboxd::replay::replay(database, kafka, pipeline, plan, replay_id).await?;
    println!(
        "replay {}: {} event(s) selected, {} republished",
        outcome.replay_id, outcome.selected, outcome.republished
    );
    if outcome.dead > 0 {
        eprintln!(
            "error: {} event(s) of the replay were dead-lettered instead of republished: see `outboxd dead list`",
            outcome.dead
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// `outboxd dead list` / `dead show`: dead events of every table with polling columns. `show` exits 1 when no
/// dead event has the id.
async fn dead(options: &Options, command: DeadCommand) -> outboxd::Result<ExitCode> {
    let settings = options.database()?;
    let client = pg::connect(&settings.database_url).await?;
    let tables: Vec<_> = pg::slot::inspect_all(&client, &settings.tables)
        .await?
        .into_iter()
        .filter(|table| table.polling)
        .collect();
    if tables.is_empty() {
        return Err(outboxd::Error::setup(
            "no outbox table has the polling columns, so none holds dead events",
            "run `outboxd migrate --add-polling-columns`",
        ));
    }
    match command {
        DeadCommand::List {
            aggregate_type,
            aggregate_id,
            since,
            limit,
            json,
            ..
        } => {
            let filter = outboxd::dead::DeadFilter {
                aggregate_type,
                aggregate_id,
                since: optional_point_in_time("--since", since.as_deref())?,
                limit: limit.max(1),
            };
            let mut events = Vec::new();
            for table in &tables {
                events.extend(outboxd::dead::list(&client, table, &filter).await?);
            }
            if json {
                println!("{}", serde_json::to_string(&events).unwrap_or_default());
            } else {
                print!("{}", outboxd::dead::to_text(&events, filter.limit));
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCommand::Show { event_id, json, .. } => {
            for table in &tables {
                if let Some((event, row)) = outboxd::dead::show(&client, table, event_id).await? {
                    if json {
                        let value = serde_json::json!({ "event": event, "row": row });
                        println!("{value}");
                    } else {
                        print!("{}", outboxd::dead::show_text(&event, &row));
                    }
                    return Ok(ExitCode::SUCCESS);
                }
            }
            eprintln!("no dead event has the id {event_id} (outboxd dead list shows them)");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// `outboxd doctor`: every check, each with its fix, and the exit code of the worst.
async fn doctor(options: &Options, json: bool) -> outboxd::Result<ExitCode> {
    let settings = options.run()?;
    let report = outboxd::doctor::examine(settings).await;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    Ok(ExitCode::from(report.level() as u8))
}

/// `outboxd status`: slot, backlog and instances, with a verdict and its exit code.
async fn status(
    options: &Options,
    json: bool,
    thresholds: &outboxd::config::Thresholds,
) -> outboxd::Result<ExitCode> {
    let settings = options.database()?;
    // Exit codes as monitoring plugins expect: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN.
    let (status, verdict) = match status::read(&settings, options.mode.unwrap_or_default()).await {
        Ok(status) => {
            let verdict = status::verdict(&status, thresholds);
            (Some(status), verdict)
        }
        Err(error) => (
            None,
            status::Verdict {
                level: status::Level::Unknown,
                reason: format!("cannot tell: {error}"),
            },
        ),
    };
    if json {
        // The status fields at the top level, plus the verdict.
        let mut value = serde_json::to_value(&status).unwrap_or_default();
        if !value.is_object() {
            value = serde_json::json!({});
        }
        value["verdict"] =
            serde_json::json!({ "level": verdict.level.as_str(), "reason": verdict.reason });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
    } else {
        if let Some(status) = &status {
            print!("{}", status.to_table());
        }
        let reason = logging::escape_controls(&verdict.reason);
        println!("{}: {reason}", verdict.level.as_str());
    }
    Ok(ExitCode::from(verdict.level as u8))
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
