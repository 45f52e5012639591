-- An item id is handed out once. After `TRUNCATE pending_triage RESTART IDENTITY`, a sequence
-- reset (setval, a restore) or a direct INSERT with an explicit id, a new item could get the id
-- of an item that already has its work_outcomes row (UNIQUE (queue, item_id)): every settle of
-- it (success and dead letter) was refused with a unique violation, so it was retried, then
-- claimed again as "worker died", refused again, for ever, and never reached failed_operations.
-- Its memory origins (`pending_triage:<id>:0`) were the old item's, and an old idempotency key
-- pointed at it. Now:
--
-- * sokratos_next_item_id(queue) takes nextval of the queue's id sequence; an id that already
--   has an outcome, that an idempotency key records (for another item), or that a queued row
--   holds is not used: the sequence is moved past the highest of those ids with one setval (not
--   one id at a time) and nextval is taken again. sokratos_enqueue (so both enqueue functions
--   and `failed retry`) takes its ids from it.
-- * The BEFORE INSERT trigger sokratos_fresh_id, on both queues, gives a row inserted directly
--   whose id (the column default's or an explicit one) already has an outcome, is recorded
--   for another item's idempotency key, or is held by a row still queued, a fresh id the same
--   way; `INSERT … RETURNING id` tells the id the row got. After a reset the default hands
--   out the ids of queued rows: left to the primary key, the new row was refused (23505) or,
--   under `INSERT … ON CONFLICT DO NOTHING`, dropped without an error, its key recorded for
--   the unrelated queued item (below). An explicit id is a wish, not a key: a trigger cannot
--   tell it from the default's, and producers deduplicate by idempotency key. Triggers of one
--   kind fire in name order, so it runs before sokratos_remember_key (0041), which records
--   the key under the id the row keeps (the fresh one). A producer's retry of the same keyed
--   row (`INSERT … ON CONFLICT DO NOTHING`, with or without the first row's id) still stays
--   one item: its key is recorded for the first row, which is queued, so sokratos_remember_key
--   lets it on to the queue's unique index on the key, which skips it (or refuses it, 23505),
--   as before. A keyless row sent twice with the same explicit id is two items now, as it
--   already was once the first had finished: a keyless row has no identity to keep.
-- * Rows queued now under an id that already has an outcome (looping as above) get a fresh id,
--   their idempotency key follows them; their next claim settles them normally.
--
-- Cost: the trigger probes the queue's primary key, work_outcomes' unique index and the new
-- index on sokratos_idempotency_keys (queue, item_id) once each per inserted row; the enqueue
-- functions probe them once more in sokratos_next_item_id. The move is rare (once after a
-- reset); it is serialised by a transaction advisory lock, so two inserts at once still get
-- distinct ids (a second one that needs the move waits for the first one's transaction, then
-- finds the sequence moved), and it leaves a gap of 1000 ids above the highest used one, so
-- inserts that drew ids in the meantime cannot pass it before the setval lands. setval is not
-- transactional: a rollback keeps the move, which is harmless. `attempts` of a row inserted
-- directly are kept (see docs/production.md, "Rows inserted directly"): the claim tells a row
-- that used its attempts without a lease apart from one whose last attempt died.

CREATE INDEX IF NOT EXISTS sokratos_idempotency_keys_item_idx
    ON sokratos_idempotency_keys (queue, item_id);

-- Whether a new row of `queue` must not get `id`: an outcome is recorded under it, or a key
-- other than `own_key` (NULL: any key) is recorded for it. Plain SQL, so it is inlined into
-- its callers' plans (both run with the owner's rights and a pinned search_path).
CREATE OR REPLACE FUNCTION sokratos_item_id_used(queue text, id bigint, own_key text)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM work_outcomes o WHERE o.queue = $1 AND o.item_id = $2)
        OR EXISTS (SELECT 1 FROM sokratos_idempotency_keys k
                   WHERE k.queue = $1 AND k.item_id = $2 AND k.key IS DISTINCT FROM $3)
$$;

CREATE OR REPLACE FUNCTION sokratos_next_item_id(queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    seq text;
    candidate bigint;
    queued boolean;
    highest bigint;
BEGIN
    IF queue IS NULL OR queue NOT IN ('pending_triage', 'pending_distillation') THEN
        RAISE EXCEPTION 'queue must be pending_triage or pending_distillation, not %', queue
            USING ERRCODE = '22023';
    END IF;
    seq := pg_get_serial_sequence(queue, 'id');
    LOOP
        candidate := nextval(seq);
        IF queue = 'pending_triage' THEN
            queued := EXISTS (SELECT 1 FROM pending_triage t WHERE t.id = candidate);
        ELSE
            queued := EXISTS (SELECT 1 FROM pending_distillation t WHERE t.id = candidate);
        END IF;
        IF NOT queued AND NOT sokratos_item_id_used(queue, candidate, NULL) THEN
            RETURN candidate;
        END IF;
        -- One mover at a time: a second one finds the sequence moved already (next draw).
        PERFORM pg_advisory_xact_lock(hashtext('sokratos_next_item_id'), hashtext(queue));
        candidate := nextval(seq);
        IF queue = 'pending_triage' THEN
            queued := EXISTS (SELECT 1 FROM pending_triage t WHERE t.id = candidate);
            SELECT max(t.id) INTO highest FROM pending_triage t;
        ELSE
            queued := EXISTS (SELECT 1 FROM pending_distillation t WHERE t.id = candidate);
            SELECT max(t.id) INTO highest FROM pending_distillation t;
        END IF;
        IF NOT queued AND NOT sokratos_item_id_used(queue, candidate, NULL) THEN
            RETURN candidate;
        END IF;
        highest := greatest(
            highest,
            (SELECT max(o.item_id) FROM work_outcomes o WHERE o.queue = sokratos_next_item_id.queue),
            (SELECT max(k.item_id) FROM sokratos_idempotency_keys k
             WHERE k.queue = sokratos_next_item_id.queue));
        IF candidate < highest THEN
            PERFORM setval(seq, highest + 1000);
            RAISE WARNING 'the id sequence of % handed out an id already used (%): moved past %',
                          queue, candidate, highest
                USING HINT = 'The sequence was reset (TRUNCATE … RESTART IDENTITY, setval, a'
                             ' restore); ids already used are never handed out again.';
        END IF;
    END LOOP;
END $$;

-- A blank key (an empty shell variable, '') is refused, not recorded: recorded, it made every
-- later item with the same blank key return the first one's id, and their text was dropped.
CREATE OR REPLACE FUNCTION sokratos_refuse_blank_key(key text) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF key ~ '^\s*$' THEN
        RAISE EXCEPTION 'idempotency key is blank'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass NULL for an item without a key, or the item''s own key'
                         ' (an empty variable?).';
    END IF;
END $$;

-- A row held under the id already (a sequence reset hands out the ids of rows still queued)
-- is another item's: the new row gets a fresh id too. Left to the primary key, it was refused
-- (23505) or, under INSERT … ON CONFLICT DO NOTHING, dropped without a word, and its key, which
-- sokratos_remember_key records under the id the row keeps, then named the unrelated queued
-- item, so the work could never be enqueued again. The same row sent again stays one: its key
-- is recorded for the first one, which is queued, so the queue's unique index on the key
-- refuses or skips it as before, whatever id it asked for.
CREATE OR REPLACE FUNCTION sokratos_fresh_id() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    queued boolean;
BEGIN
    PERFORM sokratos_refuse_blank_key(NEW.idempotency_key);
    IF TG_TABLE_NAME = 'pending_triage' THEN
        queued := EXISTS (SELECT 1 FROM pending_triage t WHERE t.id = NEW.id);
    ELSE
        queued := EXISTS (SELECT 1 FROM pending_distillation t WHERE t.id = NEW.id);
    END IF;
    IF queued OR sokratos_item_id_used(TG_TABLE_NAME, NEW.id, NEW.idempotency_key) THEN
        NEW.id := sokratos_next_item_id(TG_TABLE_NAME);
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS sokratos_fresh_id ON pending_triage;
CREATE TRIGGER sokratos_fresh_id BEFORE INSERT ON pending_triage
    FOR EACH ROW EXECUTE FUNCTION sokratos_fresh_id();
DROP TRIGGER IF EXISTS sokratos_fresh_id ON pending_distillation;
CREATE TRIGGER sokratos_fresh_id BEFORE INSERT ON pending_distillation
    FOR EACH ROW EXECUTE FUNCTION sokratos_fresh_id();

-- 0003's function, its id now from sokratos_next_item_id (the key is recorded under it).
CREATE OR REPLACE FUNCTION sokratos_enqueue(
    queue text, payload jsonb, idempotency_key text, source text
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    new_id bigint;
    existing bigint;
BEGIN
    PERFORM sokratos_check_payload(queue, payload, source);
    PERFORM sokratos_refuse_blank_key(idempotency_key);
    new_id := sokratos_next_item_id(queue);
    IF idempotency_key IS NOT NULL THEN
        INSERT INTO sokratos_idempotency_keys (queue, key, item_id)
        VALUES (queue, idempotency_key, new_id)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            SELECT k.item_id INTO existing FROM sokratos_idempotency_keys k
            WHERE k.queue = sokratos_enqueue.queue AND k.key = sokratos_enqueue.idempotency_key;
            RETURN existing;
        END IF;
    END IF;
    IF queue = 'pending_triage' THEN
        INSERT INTO pending_triage (id, payload, idempotency_key, source)
        VALUES (new_id, payload, idempotency_key, source);
    ELSE
        INSERT INTO pending_distillation (id, payload, idempotency_key)
        VALUES (new_id, payload, idempotency_key);
    END IF;
    PERFORM pg_notify('sokratos_worker', queue);
    RETURN new_id;
END $$;

-- CREATE OR REPLACE resets SECURITY DEFINER and the pinned search_path: set them (0020); the
-- inserting role needs no privilege on work_outcomes, the key table or the sequence (setval).
DO $$
DECLARE
    fn record;
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure AS signature, n.nspname AS schema
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE p.proname IN ('sokratos_enqueue', 'sokratos_next_item_id', 'sokratos_fresh_id')
          AND pg_function_is_visible(p.oid)
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp',
                       fn.signature, fn.schema);
    END LOOP;
END $$;

-- It moves a sequence with the owner's rights: only the functions above call it.
REVOKE EXECUTE ON FUNCTION sokratos_next_item_id(text) FROM PUBLIC;

-- Rows queued now under an id that is already used (they loop as described above).
DO $$
DECLARE
    q text;
    r record;
    fresh bigint;
BEGIN
    FOREACH q IN ARRAY ARRAY['pending_triage', 'pending_distillation'] LOOP
        FOR r IN EXECUTE format(
            'SELECT id, idempotency_key FROM %I WHERE sokratos_item_id_used(%L, id,'
            ' idempotency_key) ORDER BY id', q, q)
        LOOP
            fresh := sokratos_next_item_id(q);
            EXECUTE format('UPDATE %I SET id = $1 WHERE id = $2', q) USING fresh, r.id;
            UPDATE sokratos_idempotency_keys k SET item_id = fresh
            WHERE k.queue = q AND k.key = r.idempotency_key AND k.item_id = r.id;
        END LOOP;
    END LOOP;
END $$;
