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
--
-- Tables outside public (e.g. the owner's "$user" schema): found in the catalogs whoever runs
-- this, and put on the two roles' search_path in this database (see the end of the file).
-- No ALTER DEFAULT PRIVILEGES: it would give every future table of the owner the same rights
-- whatever the worker does with it, and only for tables created by the role named in it; a
-- table a migration adds is granted here, by name, when this file is run again, and until
-- then `sokratos-worker run` and `check` name the missing grant (exit 78).

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
    found text;
    tbl text;
    seq text;
    -- Read, written and deleted by the worker.
    worker_rw text[] := ARRAY[
        'pending_triage', 'pending_distillation', 'work_outcomes', 'failed_operations',
        'processed_emails', 'email_checkpoints', 'worker_heartbeats', 'sokratos_idempotency_keys'];
    -- Read by the worker: thresholds, the user's preferences, the migration history
    -- (`run --no-migrate` checks that the schema is current).
    worker_ro text[] := ARRAY['adaptive_params', 'personality_traits', 'sokratos_worker_migrations'];
    -- Their search_path (the end of the file).
    db_path text;
    server_path text;
    role_name text;
    role_path text;
    names text[];
    new_path text;
    via_database boolean := false;
BEGIN
    -- Where the worker's tables are: the schema of the enqueue functions and the migration
    -- history, looked up in the catalogs rather than through this session's search_path (a
    -- superuser's path need not include the owner's "$user" schema).
    SELECT string_agg(DISTINCT nspname, ', ' ORDER BY nspname), min(nspname) INTO found, schema_name
    FROM (SELECT n.nspname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          WHERE p.proname = 'sokratos_enqueue_triage'
          UNION
          SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.relname = 'sokratos_worker_migrations' AND c.relkind IN ('r', 'p')) AS s
    WHERE nspname NOT IN ('pg_catalog', 'information_schema');
    IF schema_name IS NULL THEN
        RAISE EXCEPTION 'sokratos_enqueue_triage not found: run `sokratos-worker migrate` first';
    END IF;
    IF found <> schema_name THEN
        RAISE EXCEPTION 'the worker''s tables or functions are in several schemas (%): drop the'
            ' copy that is not used, then run roles.sql again', found;
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

    -- The two roles name the tables and functions unqualified, so a schema other than public
    -- (the owner's "$user" schema) must be on their search_path in this database. With public
    -- the default path finds them, and nothing is set. A path that already names the schema
    -- (the role's own, or the database's, set by an earlier run or by the DBA) is left as it
    -- is, so this file can be run again; otherwise the role gets the path it has today (its
    -- own, else the database's, else the server's) with the schema put in FRONT: the worker's
    -- tables and functions must resolve to ours before any same-named object in a schema
    -- later on the path (a stray copy in public, or one planted in a schema others may write
    -- to), while everything else on that path keeps its place, e.g. pgvector's "extensions"
    -- schema named on the database's path (Supabase's layout: type vector, operator <=>).
    -- ALTER ROLE needs a superuser (or CREATEROLE with ADMIN on the roles); an owner of the
    -- database without it sets the database's default instead, with the schema LAST so that
    -- no name other roles resolve today changes. It stops (rolling back the grants) when the
    -- database has a path of its own without the schema (not ours to replace) or a role has
    -- one: only a superuser may then set the roles'.
    IF schema_name <> 'public' THEN
        SELECT substr(c, length('search_path=') + 1) INTO db_path
        FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase,
             unnest(s.setconfig) AS c
        WHERE d.datname = current_database() AND s.setrole = 0 AND c LIKE 'search_path=%';
        -- The server's path (postgresql.conf) when this session shows it, else the default.
        SELECT CASE WHEN source IN ('default', 'configuration file') THEN setting
                    ELSE '"$user", public' END INTO server_path
        FROM pg_settings WHERE name = 'search_path';

        FOREACH role_name IN ARRAY ARRAY['sokratos_worker', 'sokratos_producer'] LOOP
            -- The role's own setting: in this database first, then in every database.
            SELECT substr(c, length('search_path=') + 1) INTO role_path
            FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole,
                 unnest(s.setconfig) AS c
            WHERE r.rolname = role_name AND c LIKE 'search_path=%'
              AND s.setdatabase IN (0, (SELECT oid FROM pg_database
                                        WHERE datname = current_database()))
            ORDER BY s.setdatabase DESC LIMIT 1;
            -- The path's schema names as PostgreSQL reads them: "quoted" or lower-cased.
            SELECT coalesce(array_agg(CASE WHEN m[1] LIKE '"%'
                                           THEN replace(substr(m[1], 2, length(m[1]) - 2), '""', '"')
                                           ELSE lower(m[1]) END ORDER BY i), '{}')
            INTO names
            FROM regexp_matches(coalesce(role_path, db_path, server_path),
                                '("(?:[^"]|"")*"|[^",[:space:]]+)', 'g') WITH ORDINALITY AS t(m, i);
            IF schema_name = ANY(names) OR (schema_name = role_name AND '$user' = ANY(names)) THEN
                CONTINUE;  -- done (an earlier run, or the DBA): keep granting
            END IF;
            new_path := array_to_string(
                quote_ident(schema_name)
                    || ARRAY(SELECT quote_ident(p) FROM unnest(names) WITH ORDINALITY AS u(p, i)
                             ORDER BY i), ', ');
            BEGIN
                EXECUTE format('ALTER ROLE %I IN DATABASE %I SET search_path = %s',
                               role_name, current_database(), new_path);
                RAISE NOTICE 'search_path of % in database % set to %', role_name,
                    current_database(), new_path;
            EXCEPTION WHEN insufficient_privilege THEN
                IF role_path IS NOT NULL THEN
                    RAISE EXCEPTION 'the tables are in schema %, which % must have on its'
                        ' search_path, and it has a search_path of its own (%) without it:'
                        ' run roles.sql as a superuser', schema_name, role_name, role_path;
                END IF;
                via_database := true;
            END;
        END LOOP;

        IF via_database THEN
            -- db_path IS NOT NULL here means a path without the schema (one with it was done).
            IF NOT EXISTS (SELECT FROM pg_database WHERE datname = current_database()
                           AND pg_has_role(datdba, 'USAGE'))
               OR db_path IS NOT NULL THEN
                RAISE EXCEPTION 'the tables are in schema %, which sokratos_worker and'
                    ' sokratos_producer must have on their search_path: run roles.sql as a'
                    ' superuser (or as the owner of database %, if it sets no search_path of'
                    ' its own or one that names the schema)', schema_name, current_database();
            END IF;
            SELECT array_to_string(array_agg(quote_ident(
                       CASE WHEN m[1] LIKE '"%'
                            THEN replace(substr(m[1], 2, length(m[1]) - 2), '""', '"')
                            ELSE lower(m[1]) END) ORDER BY i)
                       || quote_ident(schema_name), ', ')
            INTO new_path
            FROM regexp_matches(server_path, '("(?:[^"]|"")*"|[^",[:space:]]+)', 'g')
                 WITH ORDINALITY AS t(m, i);
            EXECUTE format('ALTER DATABASE %I SET search_path = %s', current_database(), new_path);
            RAISE NOTICE 'this role may not alter sokratos_worker and sokratos_producer: set'
                ' search_path = % for database % instead', new_path, current_database();
        END IF;
    END IF;
END $$;
