-- A producer's `INSERT ... ON CONFLICT (idempotency_key) DO NOTHING` failed with SQLSTATE
-- 42P10 ("no unique or exclusion constraint matching the ON CONFLICT specification"): the
-- queues' key indexes were partial (WHERE idempotency_key IS NOT NULL), and a conflict target
-- infers a partial index only when the statement repeats its predicate. A plain unique index
-- means the same (NULLs are distinct: rows without a key never conflict) and is inferred by
-- both forms, with or without that WHERE. The new index is built before the old one goes, so
-- the key is unique throughout.
CREATE UNIQUE INDEX IF NOT EXISTS pending_triage_idempotency_key_all
    ON pending_triage (idempotency_key);
DROP INDEX IF EXISTS pending_triage_idempotency_key;
ALTER INDEX pending_triage_idempotency_key_all RENAME TO pending_triage_idempotency_key;

CREATE UNIQUE INDEX IF NOT EXISTS pending_distillation_idempotency_key_all
    ON pending_distillation (idempotency_key);
DROP INDEX IF EXISTS pending_distillation_idempotency_key;
ALTER INDEX pending_distillation_idempotency_key_all RENAME TO pending_distillation_idempotency_key;
