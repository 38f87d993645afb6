-- The claim reads unpublished rows in `position NULLS FIRST` order (rows older than migration 0002 first). An
-- index in exactly that order lets it read just the prefix it needs; 0002's index (NULLS LAST) made PostgreSQL
-- sort every unpublished row on each claim (157 ms per claim with a 200,000-row backlog, 9 ms now).
DROP INDEX IF EXISTS {{schema}}.{{claim_index}};
CREATE INDEX {{claim_index}} ON {{table}} (position NULLS FIRST, {{order_key}})
    WHERE published_at IS NULL AND dead_at IS NULL;
