-- A row inserted directly (contract §4) with an idempotency key that is already recorded for
-- another item is refused. The unique index on the queue only sees pending rows, and 0030's
-- trigger ignored a key it already knew, so a key whose item had finished (row deleted,
-- outcome recorded) was accepted as a second item: the Go application retrying an INSERT
-- whose COMMIT landed but whose answer was lost got the work done, and a memory written,
-- twice. The refusal is SQLSTATE 23505 (unique_violation), the one a producer gets while the
-- item is pending. Rows sokratos_enqueue inserts (also `failed retry`'s) are recorded under
-- their own id before the insert, so they pass.
CREATE OR REPLACE FUNCTION sokratos_remember_key() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    existing bigint;
BEGIN
    INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
    VALUES (TG_TABLE_NAME, NEW.idempotency_key, NEW.id)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
    WHERE k.queue = TG_TABLE_NAME AND k.key = NEW.idempotency_key;
    IF existing IS DISTINCT FROM NEW.id THEN
        RAISE EXCEPTION 'idempotency key "%" is already recorded for % item %',
                        NEW.idempotency_key, TG_TABLE_NAME, existing
            USING ERRCODE = 'unique_violation',
                  TABLE = TG_TABLE_NAME,
                  CONSTRAINT = 'sokratos_idempotency_keys_pkey',
                  DETAIL = 'A key is accepted once, also after its item finished'
                           ' (see work_outcomes for its outcome).',
                  HINT = 'The row is already queued or done: treat this as success.';
    END IF;
    RETURN NULL;
END $$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search_path: set them again (0030).
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
