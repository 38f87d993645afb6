-- outboxd replay --published and outboxd audit --heal: two small tables next to the outbox table (nothing on it
-- changes). {{replay_table}}: each replay's selection and progress, for --resume and `outboxd status`.
-- {{replayed_table}}: the events a replay or a heal handed back to the polling path, so that their records carry
-- an outboxd-replay header; a row counts only while the event's handoff_at is the one it was handed back with.
-- published_at: when the event was first published (what `outboxd replay --cancel` puts back).
CREATE TABLE IF NOT EXISTS {{replay_table}} (
    replay_id      text PRIMARY KEY,
    plan           text NOT NULL,
    state          text NOT NULL,
    stream_past    pg_lsn,
    cursor         text,
    total          bigint NOT NULL DEFAULT 0,
    done           bigint NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {{replayed_table}} (
    event_id       uuid PRIMARY KEY,
    replay_id      text NOT NULL,
    handed_back_at timestamptz NOT NULL,
    published_at   timestamptz
);
