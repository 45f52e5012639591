-- Rows the main application inserts directly (contract §4) may carry an idempotency key too.
-- sokratos_enqueue only knew the keys it had recorded itself, so enqueueing such a key raised
-- a raw unique violation while the row was pending, and created a second item (the work done
-- twice) once it had finished. A trigger records a directly inserted row's key the way
-- sokratos_enqueue does; for rows sokratos_enqueue inserts, the key is already there.
CREATE OR REPLACE FUNCTION sokratos_remember_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
    VALUES (TG_TABLE_NAME, NEW.idempotency_key, NEW.id)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS sokratos_remember_key ON pending_triage;
CREATE TRIGGER sokratos_remember_key AFTER INSERT ON pending_triage
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_remember_key();
DROP TRIGGER IF EXISTS sokratos_remember_key ON pending_distillation;
CREATE TRIGGER sokratos_remember_key AFTER INSERT ON pending_distillation
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION sokratos_remember_key();

-- The trigger runs with its owner's rights (the inserting role needs no privilege on the key
-- table), with the search_path pinned as in 0020.
DO $$
DECLARE
    fn record;
BEGIN
    SELECT p.oid::regprocedure AS signature, n.nspname AS schema INTO fn
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE p.proname = 'sokratos_remember_key' AND pg_function_is_visible(p.oid);
    EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp',
                   fn.signature, fn.schema);
END $$;

-- Keys of rows inserted directly before this migration.
INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
SELECT 'pending_triage', idempotency_key, id FROM pending_triage
WHERE idempotency_key IS NOT NULL
ON CONFLICT DO NOTHING;
INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
SELECT 'pending_distillation', idempotency_key, id FROM pending_distillation
WHERE idempotency_key IS NOT NULL
ON CONFLICT DO NOTHING;
