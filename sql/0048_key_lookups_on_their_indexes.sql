-- The queue triggers looked up keys and outcomes off their indexes. TG_TABLE_NAME is of type
-- name, whose collation is "C"; compared with the text column `queue` (default collation), the
-- comparison cannot use an index whose first column is `queue`: sokratos_idempotency_keys'
-- primary key and item index and work_outcomes' UNIQUE (queue, item_id). Every enqueue and
-- every direct INSERT read those indexes whole (PostgreSQL 18 skips through them; 15 to 17
-- scan every entry), so an enqueue cost grew with every key and outcome ever recorded. The
-- queue's name is now a text variable of the default collation.
--
-- And a plan cached in a long session (a producer's pool, `failed retry --all`, the spool
-- import) keeps what the planner chose when the queue was empty: a sequential scan of the
-- queue for each id it probes, for as long as the session lives or until the table is next
-- analysed; a bulk enqueue became quadratic. Every lookup in these functions has its index,
-- so they are planned without sequential scans.
CREATE OR REPLACE FUNCTION sokratos_remember_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queue_name text := TG_TABLE_NAME;  -- (default collation: see above)
    existing bigint;
    queued boolean;
BEGIN
    INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
    VALUES (queue_name, NEW.idempotency_key, NEW.id)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN NEW;
    END IF;
    SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
    WHERE k.queue = queue_name AND k.key = NEW.idempotency_key;
    IF existing IS NOT DISTINCT FROM NEW.id THEN
        RETURN NEW;  -- recorded by sokratos_enqueue for this very row
    END IF;
    EXECUTE format('SELECT true FROM %I WHERE id = $1', queue_name) INTO queued USING existing;
    IF queued THEN
        RETURN NEW;  -- still queued: the unique index answers (23505, or ON CONFLICT skips)
    END IF;
    PERFORM sokratos_refuse_recorded_key(queue_name, NEW.idempotency_key, existing);
    RETURN NULL;  -- (not reached: the call raises)
END $$;

CREATE OR REPLACE FUNCTION sokratos_check_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queue_name text := TG_TABLE_NAME;
    existing bigint;
BEGIN
    SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
    WHERE k.queue = queue_name AND k.key = NEW.idempotency_key;
    IF existing IS DISTINCT FROM NEW.id THEN
        PERFORM sokratos_refuse_recorded_key(queue_name, NEW.idempotency_key, existing);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION sokratos_fresh_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queue_name text := TG_TABLE_NAME;
    queued boolean;
BEGIN
    PERFORM sokratos_refuse_blank_key(NEW.idempotency_key);
    IF queue_name = 'pending_triage' THEN
        queued := EXISTS (SELECT 1 FROM pending_triage t WHERE t.id = NEW.id);
    ELSE
        queued := EXISTS (SELECT 1 FROM pending_distillation t WHERE t.id = NEW.id);
    END IF;
    IF queued OR sokratos_item_id_used(queue_name, NEW.id, NEW.idempotency_key) THEN
        NEW.id := sokratos_next_item_id(queue_name);
    END IF;
    RETURN NEW;
END $$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search_path: set them again (0041,
-- 0042), with the planning setting above for every function that looks items up.
DO $$
DECLARE
    fn record;
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure AS signature, n.nspname AS schema
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE p.proname IN ('sokratos_remember_key', 'sokratos_check_key', 'sokratos_fresh_id',
                            'sokratos_enqueue', 'sokratos_next_item_id')
          AND pg_function_is_visible(p.oid)
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp',
                       fn.signature, fn.schema);
        EXECUTE format('ALTER FUNCTION %s SET enable_seqscan = off', fn.signature);
    END LOOP;
END $$;
