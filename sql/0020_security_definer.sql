-- The enqueue functions run with their owner's rights (SECURITY DEFINER), so a producer role
-- needs nothing but EXECUTE on sokratos_enqueue_triage / sokratos_enqueue_distillation: no
-- privilege on the queue tables themselves (see sql/roles.sql). A SECURITY DEFINER function
-- must not trust the caller's search_path: it is pinned to the schema the functions live in
-- (public, unless the worker's tables were created elsewhere), with pg_temp last.
--
-- sokratos_enqueue takes the queue name from its caller; with the owner's rights it must not
-- be callable by everyone: only the two wrappers (which run as the owner) and the worker's
-- role (granted in sql/roles.sql) call it.
DO $$
DECLARE
    fn record;
BEGIN
    FOR fn IN
        SELECT p.oid::regprocedure AS signature, n.nspname AS schema
        FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE p.proname IN ('sokratos_enqueue', 'sokratos_enqueue_triage',
                            'sokratos_enqueue_distillation')
          AND pg_function_is_visible(p.oid)
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp',
                       fn.signature, fn.schema);
    END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION sokratos_enqueue(text, jsonb, text, text) FROM PUBLIC;
