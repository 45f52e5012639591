-- An archive_text longer than the worker distils (512,000 bytes) is queued again, as before
-- 0049, and dead-lettered at its claim with its payload kept in failed_operations: refused
-- at enqueue, the raw archive a producer pushes when its own distillation failed (Sokratos's
-- path has no size bound) was lost unless the producer handled the error. The size of the
-- archive a `messages` list makes was already left to the claim. Otherwise as in 0049.

CREATE OR REPLACE FUNCTION sokratos_payload_check_distillation(payload jsonb)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    i int := 0;
    message jsonb;
BEGIN
    IF jsonb_typeof(payload -> 'messages') = 'array' THEN
        FOR message IN SELECT m FROM jsonb_array_elements(payload -> 'messages') AS m LOOP
            PERFORM sokratos_payload_check_message(message, i);
            i := i + 1;
        END LOOP;
    END IF;
    PERFORM sokratos_payload_check_int(payload, 'pipeline_id');
    PERFORM sokratos_payload_check_str(payload, 'conversation_id', 'conversation_id');
END $$;
