-- Columns and indexes of the polling path. Safe on a large, live table: every column is added without a table
-- rewrite (nullable, or with a non-volatile default) in one short transaction under lock_timeout, and each
-- index is built CONCURRENTLY afterwards, so application inserts never wait behind an index build.
-- Works on a table the user created (--table): missing polling columns are added. With
-- `--existing-rows published` (the default) the rows a user's table already holds get published_at
-- '-infinity' ("published before outboxd") through the column's default, still without a rewrite; with
-- `--existing-rows unpublished` they get handoff_at '-infinity' (handed to the polling path); rows inserted
-- afterwards get NULL.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS available_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0;
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS lease_token uuid;
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS lease_until timestamptz;
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS published_at timestamptz{{published_at_default}};
{{published_at_drop_default}}
-- Dead letters: the last error, and when retrying stopped. Dead rows are never claimed.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS dead_at timestamptz;
-- Rows the replication slot will never deliver (older than the slot, or handed over by the CDC path) are the
-- polling path's while outboxd runs in cdc/auto mode.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS handoff_at timestamptz{{handoff_at_default}};
{{handoff_at_drop_default}}
-- Insert-time position: per-aggregate order in the polling path.
CREATE SEQUENCE IF NOT EXISTS {{position_seq}};
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS position bigint;
ALTER TABLE {{table}} ALTER COLUMN position SET DEFAULT nextval('{{position_seq_text}}');
ALTER SEQUENCE {{position_seq}} OWNED BY {{table}}.position;
-- The default runs with the inserting role's rights: every role that may insert gets USAGE on the sequence in
-- this same transaction (without it, an application inserting as its own role fails from here on).
{{grant_position_seq}};

-- The claim reads unpublished rows in `position NULLS FIRST` order (rows older than this migration first): an
-- index in exactly that order lets it read just the prefix it needs. (Before 0004 existed this index was built
-- NULLS LAST, and 0004 replaces such an index.)
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{claim_index}} ON {{table}} (position NULLS FIRST, {{order_key}})
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{handoff_index}} ON {{table}} ({{aggregate_key}})
    WHERE handoff_at IS NOT NULL AND published_at IS NULL AND dead_at IS NULL;
