-- Which item a `failed retry` replay replays, recorded by the worker itself. A dead-lettered
-- distillation saves its raw archive; its replay, failing again, must list that archive, not
-- save it a second time, and only its own: another conversation that reads alike is saved.
-- The replay used to be found through failed_operations.retried_as, which is lost when the
-- failure row is purged (`failed purge`, a TTL, Sokratos's prune), and through keys ending in
-- `#retry-N`, which are the producer's to choose: a producer's own `chat-42#retry-1` reused
-- `chat-42`'s archive (its own conversation never saved), and a keyless item's replay key
-- (`failed_operations:<F>#retry-1`) leads to no outcome once the failure row is gone.
--
-- * replay_of on both queues: the id of the item in the same queue whose failure this item
--   replays; set by `failed retry` in the transaction that enqueues it, NULL for every item a
--   producer enqueues (a producer has no reason to set it, and nothing reads it but the
--   archive reuse below).
-- * replay_of on work_outcomes: copied from the item by its dead letter, so the link outlives
--   failed_operations (outcomes are kept for good). The success settles leave it NULL: a
--   replay that succeeds ends its chain, and the claim and settle statements stay as they
--   were. A dead letter's archive walks these links back (store/memories.py).
-- * failed_operations (source_queue, retried_as): the link of replays enqueued before this
--   migration (or by an older worker during an upgrade), probed once per step of that walk.
--
-- Nullable columns without a default: catalog-only changes, no table rewrite.
ALTER TABLE pending_triage ADD COLUMN IF NOT EXISTS replay_of bigint;
ALTER TABLE pending_distillation ADD COLUMN IF NOT EXISTS replay_of bigint;
ALTER TABLE work_outcomes ADD COLUMN IF NOT EXISTS replay_of bigint;

COMMENT ON COLUMN pending_triage.replay_of IS
    'The pending_triage item whose failure `failed retry` replays as this item (else NULL).';
COMMENT ON COLUMN pending_distillation.replay_of IS
    'The pending_distillation item whose failure `failed retry` replays as this item (else NULL).';
COMMENT ON COLUMN work_outcomes.replay_of IS
    'A dead letter''s: the item (same queue) this item replayed; its raw archive is reused.';

CREATE INDEX IF NOT EXISTS failed_operations_retried_as_idx
    ON failed_operations (source_queue, retried_as) WHERE retried_as IS NOT NULL;

-- The links failed_operations holds today, written where they outlive it: replays still
-- queued, and the outcomes of replays already dead-lettered.
UPDATE pending_triage t SET replay_of = f.item_id
FROM failed_operations f
WHERE f.source_queue = 'pending_triage' AND f.retried_as = t.id AND f.item_id IS NOT NULL
  AND t.replay_of IS NULL;
UPDATE pending_distillation t SET replay_of = f.item_id
FROM failed_operations f
WHERE f.source_queue = 'pending_distillation' AND f.retried_as = t.id AND f.item_id IS NOT NULL
  AND t.replay_of IS NULL;
UPDATE work_outcomes o SET replay_of = f.item_id
FROM failed_operations f
WHERE f.source_queue = o.queue AND f.retried_as = o.item_id AND f.item_id IS NOT NULL
  AND o.outcome IN ('archived', 'failed') AND o.replay_of IS NULL;
