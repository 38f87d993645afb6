-- The outbox table (the pattern's reference schema) and the consumers' inbox table.
-- {{table}} and {{schema}} are replaced by quoted identifiers from --table, {{event_id}} etc. by the columns
-- of --column / --table-style.
CREATE SCHEMA IF NOT EXISTS {{schema}};

CREATE TABLE IF NOT EXISTS {{table}} (
    {{event_id}}       uuid PRIMARY KEY,
    {{aggregate_type}} text NOT NULL,
    {{aggregate_id}}   text NOT NULL,
    {{event_type}}     text NOT NULL,
    {{payload}}        jsonb NOT NULL,
    {{created_at}}     timestamptz NOT NULL DEFAULT now(),
    available_at   timestamptz NOT NULL DEFAULT now(),
    attempts       integer NOT NULL DEFAULT 0,
    lease_token    uuid,
    lease_until    timestamptz,
    published_at   timestamptz
);

CREATE TABLE IF NOT EXISTS {{schema}}.consumed_event (
    consumer_name text NOT NULL,
    event_id      uuid NOT NULL,
    consumed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, event_id)
);
