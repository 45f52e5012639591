-- A distillation payload is `messages` or `archive_text`, not both. The worker refuses one
-- that holds both ("messages: or archive_text is required (exactly one of them)", so it is
-- dead-lettered and a replay fails the same way), but this check let it on to the queue: the
-- producer learned nothing at enqueue. A field sent as null still counts as absent, as in
-- the worker (a Go struct without omitempty). Otherwise as in 0003.

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
    ELSIF COALESCE(jsonb_typeof(payload -> 'messages'), 'null') <> 'null'
          AND COALESCE(jsonb_typeof(payload -> 'archive_text'), 'null') <> 'null' THEN
        RAISE EXCEPTION 'payload.messages and payload.archive_text are alternatives: send one of them'
            USING ERRCODE = '22023';
    ELSIF jsonb_typeof(payload -> 'messages') IS DISTINCT FROM 'array'
          AND jsonb_typeof(payload -> 'archive_text') IS DISTINCT FROM 'string' THEN
        RAISE EXCEPTION 'payload.messages (an array) or payload.archive_text (a string) is required'
            USING ERRCODE = '22023';
    END IF;
END $$;
