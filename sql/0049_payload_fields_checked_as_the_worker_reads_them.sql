-- The enqueue check looked at the payload's top level only: a message without a role (or with
-- "bot"), `messages: [1]`, `tools_used: "yes"`, `pipeline_id: "abc"`, `occurred_at: "soon"`,
-- `conversation_id: 5` were queued, then dead-lettered at the first claim ("invalid payload:
-- messages[0].role must be one of ..."), so a producer calling these functions learned of its
-- mistake only from failed_operations. sokratos_check_payload now refuses (SQLSTATE 22023,
-- the field named in the worker's words) whatever the worker's pipelines refuse for a field's
-- presence, type or allowed values, and nothing else:
--
--   conversation: exchange; unless the exchange is trivial (under 20 bytes once stripped,
--     which the worker skips before reading anything else) tools_used (boolean),
--     occurred_at (ISO-8601, as Python's datetime.fromisoformat reads it), pipeline_id
--     (a 64-bit integer); email: text, and subject, from, message_id, account (strings);
--   distillation: messages or archive_text; each message an object with a role of user,
--     assistant, tool or system, content / name / tool_call_id / timestamp strings, an
--     assistant's tool_calls a list of objects; archive_text at most 512,000 bytes;
--     pipeline_id (a 64-bit integer), conversation_id (a string).
--
-- A null counts as absent everywhere, as in the worker (a Go struct without omitempty).
-- Left to the claim, as impractical here: the 512,000-byte limit of the archive a `messages`
-- list makes (the worker's formatting, with its cleaning and bounds, decides its size), and a
-- payload Python's JSON parser cannot read (nested thousands deep, an integer of over 4,300
-- digits). The Python client's offline check (sokratos_worker/client.py) makes the same checks
-- with the worker's own code; tests/core/test_enqueue_check_agrees_with_the_worker.py holds
-- the three verdicts equal over a corpus.

-- The characters Python's str.strip() removes (str.isspace), which btrim does not know.
CREATE OR REPLACE FUNCTION sokratos_payload_strip(raw text)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT regexp_replace(
        raw,
        '^[\t\n\u000b\f\r\u001c-\u001f \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+'
        '|[\t\n\u000b\f\r\u001c-\u001f \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]+$',
        '', 'g')
$$;

-- The Python type name the worker's messages use ("must be a string, not int").
CREATE OR REPLACE FUNCTION sokratos_payload_type(v jsonb)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE jsonb_typeof(v)
        WHEN 'string' THEN 'str'
        WHEN 'boolean' THEN 'bool'
        WHEN 'array' THEN 'list'
        WHEN 'object' THEN 'dict'
        WHEN 'number' THEN CASE WHEN v::text ~ '^-?[0-9]+$' THEN 'int' ELSE 'float' END
        ELSE 'NoneType'
    END
$$;

-- CPython's parse_hh_mm_ss_ff (Modules/_datetimemodule.c) over the characters [p, e) of s:
-- rv -1 when unreadable, 0 when it ended at the string's end, 1 when something follows.
CREATE OR REPLACE FUNCTION sokratos_payload_clock(
    s text, p int, e int, OUT rv int, OUT hh int, OUT mm int, OUT ss int
) LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    vals int[] := ARRAY[0, 0, 0];
    c text;
    has_sep boolean := true;
    to_parse int;
BEGIN
    rv := -1;
    FOR i IN 1..3 LOOP
        IF substr(s, p, 2) !~ '^[0-9]{2}$' THEN
            RETURN;
        END IF;
        vals[i] := substr(s, p, 2)::int;
        c := substr(s, p + 2, 1);  -- '' past the end, as C reads its '\0'
        p := p + 3;
        IF i = 1 THEN
            has_sep := c = ':';
        END IF;
        IF p >= e THEN
            rv := CASE WHEN c = '' THEN 0 ELSE 1 END;
            hh := vals[1]; mm := vals[2]; ss := vals[3];
            RETURN;
        ELSIF has_sep AND c = ':' THEN
            CONTINUE;
        ELSIF c IN ('.', ',') THEN
            EXIT;
        ELSIF NOT has_sep THEN
            p := p - 1;
        ELSE
            RETURN;
        END IF;
    END LOOP;
    to_parse := least(e - p, 6);  -- the fraction: six digits read, more skipped
    IF to_parse > 0 AND substr(s, p, to_parse) !~ ('^[0-9]{' || to_parse || '}$') THEN
        RETURN;
    END IF;
    p := p + greatest(to_parse, 0);
    WHILE substr(s, p, 1) ~ '^[0-9]$' LOOP
        p := p + 1;
    END LOOP;
    rv := CASE WHEN substr(s, p, 1) = '' THEN 0 ELSE 1 END;
    hh := vals[1]; mm := vals[2]; ss := vals[3];
END $$;

-- Where CPython's fromisoformat splits the date from the time (its own rules, week dates too).
CREATE OR REPLACE FUNCTION sokratos_payload_date_end(s text)
RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    n int := length(s);
    idx int;
BEGIN
    IF n = 7 THEN
        RETURN 7;
    END IF;
    IF substr(s, 5, 1) = '-' THEN
        IF substr(s, 6, 1) <> 'W' THEN
            RETURN 10;
        END IF;
        IF n > 8 AND substr(s, 9, 1) = '-' THEN
            IF n = 9 THEN
                RETURN NULL;
            END IF;
            RETURN CASE WHEN n > 10 AND substr(s, 11, 1) ~ '^[0-9]$' THEN 8 ELSE 10 END;
        END IF;
        RETURN 8;
    END IF;
    IF substr(s, 5, 1) <> 'W' THEN
        RETURN 8;
    END IF;
    idx := 7;  -- 0-based, as in C: the first character after YYYYWww
    WHILE idx < n AND substr(s, idx + 1, 1) ~ '^[0-9]$' LOOP
        idx := idx + 1;
    END LOOP;
    IF idx < 9 THEN
        RETURN idx;
    END IF;
    RETURN CASE WHEN idx % 2 = 0 THEN 7 ELSE 8 END;
END $$;

-- The date part as CPython reads it: YYYY-MM-DD, YYYYMMDD, or an ISO week date.
CREATE OR REPLACE FUNCTION sokratos_payload_date_ok(d text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    g text[];
    y int;
    w int;
    jan1 date;
    monday date;
BEGIN
    g := regexp_match(d, '^([0-9]{4})-?([0-9]{2})-?([0-9]{2})$');
    IF g IS NOT NULL AND (d ~ '^[0-9]{8}$' OR d ~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}$') THEN
        y := g[1]::int;
        IF y < 1 OR g[2]::int NOT BETWEEN 1 AND 12 THEN
            RETURN false;  -- (checked first: make_date would raise, not answer)
        END IF;
        RETURN g[3]::int BETWEEN 1 AND extract(day FROM make_date(y, g[2]::int, 1)
                                                     + interval '1 month' - interval '1 day');
    END IF;
    g := regexp_match(d, '^([0-9]{4})(-?)W([0-9]{2})(?:(-?)([0-9]))?$');
    IF g IS NULL OR (g[5] IS NOT NULL AND g[4] <> g[2]) THEN
        RETURN false;
    END IF;
    y := g[1]::int;
    w := g[3]::int;
    IF y < 1 OR w < 1 OR w > 53 OR COALESCE(g[5]::int, 1) NOT BETWEEN 1 AND 7 THEN
        RETURN false;
    END IF;
    jan1 := make_date(y, 1, 1);
    IF w = 53 AND NOT (extract(isodow FROM jan1) = 4
                       OR (extract(isodow FROM jan1) = 3
                           AND extract(day FROM make_date(y, 3, 1) - 1) = 29)) THEN
        RETURN false;  -- only a year starting on a Thursday (a leap year: Wednesday) has 53
    END IF;
    monday := make_date(y, 1, 4) - (extract(isodow FROM make_date(y, 1, 4))::int - 1);
    RETURN extract(year FROM monday + (w - 1) * 7 + COALESCE(g[5]::int, 1) - 1) <= 9999;
END $$;

-- True when Python's datetime.fromisoformat reads s: a port of CPython 3.11's C parser, quirks
-- and all (tests/core/test_enqueue_check_agrees_with_the_worker.py compares the two).
CREATE OR REPLACE FUNCTION sokratos_payload_iso_ok(s text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    n int := length(s);
    date_end int;
    t int;
    tz int;
    clock record;
    offset_clock record;
BEGIN
    IF n < 7 THEN
        RETURN false;
    END IF;
    date_end := sokratos_payload_date_end(s);
    IF date_end IS NULL OR NOT sokratos_payload_date_ok(substr(s, 1, date_end)) THEN
        RETURN false;
    END IF;
    IF n <= date_end THEN
        RETURN true;
    END IF;
    t := date_end + 2;  -- the separator may be any one character
    tz := t;
    WHILE tz <= n AND substr(s, tz, 1) NOT IN ('Z', '+', '-') LOOP
        tz := tz + 1;
    END LOOP;
    SELECT * INTO clock FROM sokratos_payload_clock(s, t, tz);
    IF clock.rv < 0 OR clock.hh > 23 OR clock.mm > 59 OR clock.ss > 59 THEN
        RETURN false;
    END IF;
    IF tz > n THEN
        RETURN clock.rv = 0;
    END IF;
    IF substr(s, tz, 1) = 'Z' THEN
        RETURN tz = n;
    END IF;
    SELECT * INTO offset_clock FROM sokratos_payload_clock(s, tz + 1, n + 1);
    RETURN offset_clock.rv = 0
        AND offset_clock.hh * 3600 + offset_clock.mm * 60 + offset_clock.ss < 86400;
END $$;

-- optional_iso_datetime (pipelines/payload.py): stripped; blank or year 0000 means none.
CREATE OR REPLACE FUNCTION sokratos_payload_check_occurred_at(payload jsonb)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    value text;
BEGIN
    PERFORM sokratos_payload_check_str(payload, 'occurred_at', 'occurred_at');
    value := sokratos_payload_strip(payload ->> 'occurred_at');
    IF value <> '' AND value NOT LIKE '0000-%'
       AND NOT sokratos_payload_iso_ok(replace(value, 'Z', '+00:00')) THEN
        RAISE EXCEPTION 'payload.occurred_at must be an ISO-8601 timestamp'
            USING ERRCODE = '22023';
    END IF;
END $$;

-- A field that may be absent or null, else a string (``shown`` is its name in the message).
CREATE OR REPLACE FUNCTION sokratos_payload_check_str(obj jsonb, key text, shown text)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF COALESCE(jsonb_typeof(obj -> key), 'null') NOT IN ('null', 'string') THEN
        RAISE EXCEPTION 'payload.% must be a string, not %', shown,
            sokratos_payload_type(obj -> key) USING ERRCODE = '22023';
    END IF;
END $$;

-- optional_int: an integer (not a boolean) that fits in a bigint, or absent/null.
CREATE OR REPLACE FUNCTION sokratos_payload_check_int(payload jsonb, key text)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    kind text := sokratos_payload_type(payload -> key);
BEGIN
    IF kind NOT IN ('NoneType', 'int') THEN
        RAISE EXCEPTION 'payload.% must be an integer, not %', key, kind USING ERRCODE = '22023';
    END IF;
    IF kind = 'int' AND (payload -> key)::text::numeric
                        NOT BETWEEN -9223372036854775808 AND 9223372036854775807 THEN
        RAISE EXCEPTION 'payload.% must fit in a 64-bit integer', key USING ERRCODE = '22023';
    END IF;
END $$;

-- The triage pipeline's reads past `exchange` / `text` (pipelines/triage.py, in its order).
CREATE OR REPLACE FUNCTION sokratos_payload_check_triage(payload jsonb, source text)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    field text;
BEGIN
    IF source = 'email' THEN
        FOREACH field IN ARRAY ARRAY['subject', 'from', 'message_id', 'account'] LOOP
            PERFORM sokratos_payload_check_str(payload, field, field);
        END LOOP;
        RETURN;
    END IF;
    IF octet_length(sokratos_payload_strip(payload ->> 'exchange')) < 20 THEN
        RETURN;  -- skipped as trivial before any other field is read
    END IF;
    IF COALESCE(jsonb_typeof(payload -> 'tools_used'), 'null') NOT IN ('null', 'boolean') THEN
        RAISE EXCEPTION 'payload.tools_used must be a boolean, not %',
            sokratos_payload_type(payload -> 'tools_used') USING ERRCODE = '22023';
    END IF;
    PERFORM sokratos_payload_check_occurred_at(payload);
    PERFORM sokratos_payload_check_int(payload, 'pipeline_id');
END $$;

-- One message of a `messages` archive (pipelines/archive.py, _format_message, in its order).
CREATE OR REPLACE FUNCTION sokratos_payload_check_message(message jsonb, i int)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    place text := format('messages[%s]', i);
    key text;
    stamp text;
    j int := 0;
    tool_call jsonb;
BEGIN
    IF jsonb_typeof(message) <> 'object' THEN
        RAISE EXCEPTION 'payload.% must be an object', place USING ERRCODE = '22023';
    END IF;
    IF jsonb_typeof(message -> 'role') IS DISTINCT FROM 'string'
       OR message ->> 'role' NOT IN ('user', 'assistant', 'tool', 'system') THEN
        RAISE EXCEPTION 'payload.%.role must be one of [''assistant'', ''system'', ''tool'', ''user'']', place
            USING ERRCODE = '22023';
    END IF;
    FOREACH key IN ARRAY ARRAY['content', 'name', 'tool_call_id', 'timestamp'] LOOP
        IF COALESCE(jsonb_typeof(message -> key), 'null') NOT IN ('null', 'string') THEN
            RAISE EXCEPTION 'payload.%.% must be a string', place, key USING ERRCODE = '22023';
        END IF;
    END LOOP;
    stamp := message ->> 'timestamp';  -- not stripped before parsing, as _timestamp_prefix
    IF stamp <> '' AND sokratos_payload_strip(stamp) NOT LIKE '0000-%'
       AND NOT sokratos_payload_iso_ok(replace(stamp, 'Z', '+00:00')) THEN
        RAISE EXCEPTION 'payload.%.timestamp must be an ISO-8601 timestamp', place
            USING ERRCODE = '22023';
    END IF;
    IF message ->> 'role' <> 'assistant'
       OR COALESCE(jsonb_typeof(message -> 'tool_calls'), 'null') = 'null' THEN
        RETURN;  -- only an assistant's tool calls are read
    END IF;
    IF jsonb_typeof(message -> 'tool_calls') <> 'array' THEN
        RAISE EXCEPTION 'payload.%.tool_calls must be a list', place USING ERRCODE = '22023';
    END IF;
    FOR tool_call IN SELECT c FROM jsonb_array_elements(message -> 'tool_calls') AS c LOOP
        IF jsonb_typeof(tool_call) <> 'object' THEN
            RAISE EXCEPTION 'payload.%.tool_calls[%] must be an object', place, j
                USING ERRCODE = '22023';
        END IF;
        j := j + 1;
    END LOOP;
END $$;

-- The distillation pipeline's reads past the choice of shape (pipelines/distill.py).
CREATE OR REPLACE FUNCTION sokratos_payload_check_distillation(payload jsonb)
RETURNS void LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    i int := 0;
    message jsonb;
    archive_bytes int;
BEGIN
    IF jsonb_typeof(payload -> 'messages') = 'array' THEN
        FOR message IN SELECT m FROM jsonb_array_elements(payload -> 'messages') AS m LOOP
            PERFORM sokratos_payload_check_message(message, i);
            i := i + 1;
        END LOOP;
    ELSE
        archive_bytes := octet_length(payload ->> 'archive_text');
        IF archive_bytes > 512000 THEN
            RAISE EXCEPTION 'payload.archive_text would make an archive of % bytes; at most 512,000 are distilled: split the conversation into several items',
                to_char(archive_bytes, 'FM999,999,999,999') USING ERRCODE = '22023';
        END IF;
    END IF;
    PERFORM sokratos_payload_check_int(payload, 'pipeline_id');
    PERFORM sokratos_payload_check_str(payload, 'conversation_id', 'conversation_id');
END $$;

-- 0046's checks of the top level, in its words, then the fields' own.
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
        PERFORM sokratos_payload_check_triage(payload, source);
    ELSIF COALESCE(jsonb_typeof(payload -> 'messages'), 'null') <> 'null'
          AND COALESCE(jsonb_typeof(payload -> 'archive_text'), 'null') <> 'null' THEN
        RAISE EXCEPTION 'payload.messages and payload.archive_text are alternatives: send one of them'
            USING ERRCODE = '22023';
    ELSIF jsonb_typeof(payload -> 'messages') IS DISTINCT FROM 'array'
          AND jsonb_typeof(payload -> 'archive_text') IS DISTINCT FROM 'string' THEN
        RAISE EXCEPTION 'payload.messages (an array) or payload.archive_text (a string) is required'
            USING ERRCODE = '22023';
    ELSE
        PERFORM sokratos_payload_check_distillation(payload);
    END IF;
END $$;
