-- Least-privilege PostgreSQL roles for sokratos-worker. NOT a migration: never applied
-- automatically. Run it once per database, as a superuser or the role that owns the tables,
-- AFTER the migrations (`sokratos-worker migrate`), and again after an upgrade that adds
-- tables. Idempotent: roles are created only when missing (they are cluster-wide), grants
-- and revokes can be repeated.
--
--   psql "postgresql://owner@db/sokratos" -v ON_ERROR_STOP=1 -f sql/roles.sql
--
-- Then give the login roles a password (never stored in this file):
--   ALTER ROLE sokratos_worker PASSWORD 'choose-one';
--   ALTER ROLE sokratos_producer PASSWORD 'choose-another';
-- or let an existing application role produce work instead:
--   GRANT sokratos_producer TO sokratos_app;
--
-- sokratos_worker    runs `sokratos-worker run --no-migrate` (SOKRATOS_MIGRATE_ON_START=false):
--                    reads and writes the queues, outcomes, failures, memories, email
--                    bookkeeping and heartbeats; cannot create, alter or drop anything.
-- sokratos_producer  may only call sokratos_enqueue_triage and sokratos_enqueue_distillation
--                    (SECURITY DEFINER since migration 0020): it cannot read or write any
--                    table, not even the queues it fills.
--
-- The migrations stay with the owner of the tables (the role that ran them, or Sokratos's own
-- role for an existing database): `sokratos-worker migrate` as that role.
-- On PostgreSQL 14 and older, also run: REVOKE CREATE ON SCHEMA public FROM PUBLIC;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'sokratos_worker') THEN
        CREATE ROLE sokratos_worker LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT
            NOREPLICATION NOBYPASSRLS CONNECTION LIMIT 64;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'sokratos_producer') THEN
        CREATE ROLE sokratos_producer LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT
            NOREPLICATION NOBYPASSRLS CONNECTION LIMIT 32;
    END IF;
END $$;

DO $$
DECLARE
    schema_name text;
    tbl text;
    seq text;
    -- Read, written and deleted by the worker.
    worker_rw text[] := ARRAY[
        'pending_triage', 'pending_distillation', 'work_outcomes', 'failed_operations',
        'processed_emails', 'email_checkpoints', 'worker_heartbeats', 'sokratos_idempotency_keys'];
    -- Read by the worker: thresholds, the user's preferences, the migration history
    -- (`run --no-migrate` checks that the schema is current).
    worker_ro text[] := ARRAY['adaptive_params', 'personality_traits', 'sokratos_worker_migrations'];
BEGIN
    -- Where the worker's tables are: the schema of the enqueue functions.
    SELECT n.nspname INTO schema_name
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.proname = 'sokratos_enqueue_triage' AND pg_function_is_visible(p.oid);
    IF schema_name IS NULL THEN
        RAISE EXCEPTION 'sokratos_enqueue_triage not found: run `sokratos-worker migrate` first';
    END IF;

    EXECUTE format('GRANT CONNECT ON DATABASE %I TO sokratos_worker, sokratos_producer',
                   current_database());
    EXECUTE format('GRANT USAGE ON SCHEMA %I TO sokratos_worker, sokratos_producer', schema_name);

    FOREACH tbl IN ARRAY worker_rw LOOP
        IF to_regclass(format('%I.%I', schema_name, tbl)) IS NOT NULL THEN
            EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %I.%I TO sokratos_worker',
                           schema_name, tbl);
        END IF;
    END LOOP;
    -- Memories are written and superseded, never deleted, by the worker.
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON %I.memories TO sokratos_worker', schema_name);
    FOREACH tbl IN ARRAY worker_ro LOOP
        IF to_regclass(format('%I.%I', schema_name, tbl)) IS NOT NULL THEN
            EXECUTE format('GRANT SELECT ON %I.%I TO sokratos_worker', schema_name, tbl);
        END IF;
    END LOOP;

    -- The sequences behind those tables' serial and identity columns (nextval for inserts).
    FOR seq IN
        SELECT DISTINCT d.objid::regclass::text
        FROM pg_depend d
        JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
        WHERE d.classid = 'pg_class'::regclass
          AND d.refclassid = 'pg_class'::regclass
          AND d.deptype IN ('a', 'i')
          AND d.refobjid IN (
              SELECT to_regclass(format('%I.%I', schema_name, t))
              FROM unnest(worker_rw || ARRAY['memories']) AS t)
    LOOP
        EXECUTE format('GRANT USAGE, SELECT ON SEQUENCE %s TO sokratos_worker', seq);
    END LOOP;

    -- The enqueue functions: callable by these roles only, not by every role that can
    -- connect (the function owner keeps its rights).
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %I.sokratos_enqueue_triage(jsonb, text, text), '
                   '%I.sokratos_enqueue_distillation(jsonb, text), '
                   '%I.sokratos_enqueue(text, jsonb, text, text) FROM PUBLIC',
                   schema_name, schema_name, schema_name);
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.sokratos_enqueue_triage(jsonb, text, text), '
                   '%I.sokratos_enqueue_distillation(jsonb, text) '
                   'TO sokratos_producer, sokratos_worker', schema_name, schema_name);
    EXECUTE format('GRANT EXECUTE ON FUNCTION %I.sokratos_enqueue(text, jsonb, text, text), '
                   '%I.sokratos_check_payload(text, jsonb, text) TO sokratos_worker',
                   schema_name, schema_name);
END $$;
