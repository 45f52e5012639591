-- A direct INSERT (contract §4) and sokratos_enqueue racing on one idempotency key deadlocked
-- (SQLSTATE 40P01): the INSERT wrote its row (taking the key in the queue's unique index) and
-- only then, in 0040's AFTER trigger, the key in sokratos_idempotency_keys; sokratos_enqueue
-- takes the key first and the row second. Each waited for the other's transaction. The
-- trigger now records the key BEFORE the row is written, in sokratos_enqueue's order, so the
-- second of the two waits for the first to finish and then gets its documented answer.
--
-- A key recorded for an item that is still queued lets the row go on to the queue's unique
-- index, which refuses it with 23505 as before, or skips it under INSERT … ON CONFLICT DO
-- NOTHING (a producer's usual retry). A key recorded for an item that finished (or for none)
-- is refused here with 23505, as in 0040. The queued item is not locked: a lock (FOR KEY
-- SHARE) would hold it until the producer's transaction ends, so the item's settle would
-- wait for that transaction, and deadlock (40P01) with a producer that goes on to retry the
-- item the settling statement has just claimed. Should the item finish between this check
-- and the index (its row deleted), the row is written, and sokratos_check_key, AFTER it,
-- refuses it with the same 23505: a row is kept only under a key recorded for itself.
-- The refusal both triggers give (0040's message): SQLSTATE 23505, naming the key's item.
CREATE OR REPLACE FUNCTION sokratos_refuse_recorded_key(queue text, key text, existing bigint)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'idempotency key "%" is already recorded for % item %', key, queue, existing
        USING ERRCODE = 'unique_violation',
              TABLE = queue,
              CONSTRAINT = 'sokratos_idempotency_keys_pkey',
              DETAIL = 'A key is accepted once, also after its item finished'
                       ' (see work_outcomes for its outcome).',
              HINT = 'The row is already queued or done: treat this as success.';
END $$;

CREATE OR REPLACE FUNCTION sokratos_remember_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    existing bigint;
    queued boolean;
BEGIN
    INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
    VALUES (TG_TABLE_NAME, NEW.idempotency_key, NEW.id)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN NEW;
    END IF;
    SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
    WHERE k.queue = TG_TABLE_NAME AND k.key = NEW.idempotency_key;
    IF existing IS NOT DISTINCT FROM NEW.id THEN
        RETURN NEW;  -- recorded by sokratos_enqueue for this very row
    END IF;
    EXECUTE format('SELECT true FROM %I WHERE id = $1', TG_TABLE_NAME)
        INTO queued USING existing;
    IF queued THEN
        RETURN NEW;  -- still queued: the unique index answers (23505, or ON CONFLICT skips)
    END IF;
    PERFORM sokratos_refuse_recorded_key(TG_TABLE_NAME, NEW.idempotency_key, existing);
    RETURN NULL;  -- (not reached: the call raises)
END $$;

-- The row written: its key must be recorded for it. Otherwise the item the key is recorded
-- for finished after sokratos_remember_key found it queued (see above).
CREATE OR REPLACE FUNCTION sokratos_check_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    existing bigint;
BEGIN
    SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
    WHERE k.queue = TG_TABLE_NAME AND k.key = NEW.idempotency_key;
    IF existing IS DISTINCT FROM NEW.id THEN
        PERFORM sokratos_refuse_recorded_key(TG_TABLE_NAME, NEW.idempotency_key, existing);
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS sokratos_remember_key ON pending_triage;
CREATE TRIGGER sokratos_remember_key BEFORE INSERT ON pending_triage
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_remember_key();
DROP TRIGGER IF EXISTS sokratos_remember_key ON pending_distillation;
CREATE TRIGGER sokratos_remember_key BEFORE INSERT ON pending_distillation
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_remember_key();
DROP TRIGGER IF EXISTS sokratos_check_key ON pending_triage;
CREATE TRIGGER sokratos_check_key AFTER INSERT ON pending_triage
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_check_key();
DROP TRIGGER IF EXISTS sokratos_check_key ON pending_distillation;
CREATE TRIGGER sokratos_check_key AFTER INSERT ON pending_distillation
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_check_key();

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search_path: set them again (0030);
-- the inserting role needs no privilege on the key table or the queue's other rows.
DO $$
DECLARE
    fn record;
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure AS signature, n.nspname AS schema
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE p.proname IN ('sokratos_remember_key', 'sokratos_check_key')
          AND pg_function_is_visible(p.oid)
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp',
                       fn.signature, fn.schema);
    END LOOP;
END $$;
