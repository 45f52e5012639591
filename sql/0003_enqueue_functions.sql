-- The producers' interface (contract §4): validate, remember the idempotency key, insert,
-- wake the workers. Runs inside the caller's transaction; NOTIFY is delivered at its commit.

CREATE OR REPLACE FUNCTION sokratos_check_payload(queue text, payload jsonb, source text)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF payload IS NULL OR jsonb_typeof(payload) <> 'object' THEN
        RAISE EXCEPTION 'payload must be a JSON object' USING ERRCODE = '22023';
    END IF;
    IF queue = 'pending_triage' THEN
        IF source = 'conversation' THEN
            IF jsonb_typeof(payload -> 'exchange') IS DISTINCT FROM 'string' THEN
                RAISE EXCEPTION 'payload.exchange is required and must be a string'
                    USING ERRCODE = '22023';
            END IF;
        ELSIF source = 'email' THEN
            IF jsonb_typeof(payload -> 'text') IS DISTINCT FROM 'string' THEN
                RAISE EXCEPTION 'payload.text is required and must be a string'
                    USING ERRCODE = '22023';
            END IF;
        ELSE
            RAISE EXCEPTION 'source must be conversation or email, not %', source
                USING ERRCODE = '22023';
        END IF;
    ELSIF jsonb_typeof(payload -> 'messages') IS DISTINCT FROM 'array'
          AND jsonb_typeof(payload -> 'archive_text') IS DISTINCT FROM 'string' THEN
        RAISE EXCEPTION 'payload.messages (an array) or payload.archive_text (a string) is required'
            USING ERRCODE = '22023';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION sokratos_enqueue(
    queue text, payload jsonb, idempotency_key text, source text
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    new_id bigint;
    existing bigint;
BEGIN
    PERFORM sokratos_check_payload(queue, payload, source);
    new_id := nextval(pg_get_serial_sequence(queue, 'id'));
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

CREATE OR REPLACE FUNCTION sokratos_enqueue_triage(
    payload jsonb, idempotency_key text DEFAULT NULL, source text DEFAULT 'conversation'
) RETURNS bigint LANGUAGE sql AS $$
    SELECT sokratos_enqueue('pending_triage', payload, idempotency_key, source)
$$;

CREATE OR REPLACE FUNCTION sokratos_enqueue_distillation(
    payload jsonb, idempotency_key text DEFAULT NULL
) RETURNS bigint LANGUAGE sql AS $$
    SELECT sokratos_enqueue('pending_distillation', payload, idempotency_key, 'distillation')
$$;

-- Rows the Go application inserts directly also wake the workers.
CREATE OR REPLACE FUNCTION sokratos_notify_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('sokratos_worker', TG_TABLE_NAME);
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS pending_triage_notify ON pending_triage;
CREATE TRIGGER pending_triage_notify AFTER INSERT ON pending_triage
    FOR EACH STATEMENT EXECUTE FUNCTION sokratos_notify_insert();
DROP TRIGGER IF EXISTS pending_distillation_notify ON pending_distillation;
CREATE TRIGGER pending_distillation_notify AFTER INSERT ON pending_distillation
    FOR EACH STATEMENT EXECUTE FUNCTION sokratos_notify_insert();
