-- Catalog reads behind the `sdcore db upgrade` report (sdcore.postgres.upgrade).
-- Names resolve exactly as a query would resolve them (search_path included).

-- name: schema_exists
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)

-- name: table_oid
-- NULL when the table does not exist.
SELECT to_regclass(%s)::oid

-- name: index_count
SELECT count(*) FROM pg_index WHERE indrelid = %s::oid

-- name: schema_lock
-- The session form of the lock migrate() takes per transaction (re-entrant for this session).
SELECT pg_advisory_lock(%s)

-- name: schema_unlock
SELECT pg_advisory_unlock(%s)
