-- `outboxd dead show`: the history of an event's failed attempts (when, which attempt, why, whether it counted
-- against --max-attempts), the last 20, as a JSON array on the row. Written only when an attempt fails, so a
-- published event that never failed never gets one. Nullable, no default: added without a table rewrite.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS attempt_errors jsonb;
