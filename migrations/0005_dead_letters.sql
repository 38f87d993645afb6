-- `outboxd status` and the periodic figures count dead-lettered events; this index finds them without scanning
-- the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{dead_index}} ON {{table}} (dead_at)
    WHERE dead_at IS NOT NULL AND published_at IS NULL;
