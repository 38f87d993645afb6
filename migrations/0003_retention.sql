-- Retention deletes published rows by age in small batches; this index finds them without scanning the table.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{published_index}} ON {{table}} (published_at) WHERE published_at IS NOT NULL;
