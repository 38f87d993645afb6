-- Run once by the postgres image, as the superuser, in database `app` (POSTGRES_DB), when it initialises an
-- empty data directory (/docker-entrypoint-initdb.d/). After changing it, start from a fresh directory:
-- `docker compose -f docker/compose.yml down -v`.
--
-- Two roles, as README's "Use it with your PostgreSQL and Kafka" advises; neither is a superuser:
--   app      the application's role: owns the database, so the outbox table `outboxd migrate` creates in it
--            (migrate runs as the table's owner: it creates the tables, indexes and the publication).
--   outboxd  what `outboxd run` connects as: LOGIN and REPLICATION (for its slot), owns nothing. The
--            outboxd-grant service gives it SELECT and UPDATE on the outbox table once migrate created it.
-- The passwords are the demo's; each also stands in its URL file in docker/secrets/ (change both together).
CREATE ROLE app LOGIN PASSWORD 'app-demo-password';
CREATE ROLE outboxd LOGIN REPLICATION PASSWORD 'outboxd-demo-password';
ALTER DATABASE app OWNER TO app;
