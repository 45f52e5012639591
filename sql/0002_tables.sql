-- Every table of the contract (§3). Tables that an existing Sokratos database already has
-- (memories, failed_operations, processed_emails, adaptive_params) are adopted: created only
-- when missing, then given the worker's extra columns, never altered otherwise.

-- Sokratos's long-term memory. In a database the worker creates, the embedding has no fixed
-- dimension and may be NULL (no embedding model configured).
CREATE TABLE IF NOT EXISTS memories (
    id                bigserial PRIMARY KEY,
    summary           text NOT NULL,
    embedding         vector,
    salience          double precision DEFAULT 5,
    tags              text[],
    created_at        timestamptz DEFAULT now(),
    last_accessed     timestamptz DEFAULT now(),
    memory_type       varchar(20) DEFAULT 'general',
    entities          text[],
    confidence        double precision DEFAULT 1.0,
    related_ids       bigint[],
    superseded_by     bigint REFERENCES memories (id),
    retrieval_count   int DEFAULT 0,
    last_retrieved_at timestamptz,
    usefulness_score  double precision DEFAULT 0.5,
    source            varchar(50),
    source_date       timestamptz,
    pipeline_id       bigint,
    summary_tsv       tsvector GENERATED ALWAYS AS (to_tsvector('english', summary)) STORED
);
ALTER TABLE memories ADD COLUMN IF NOT EXISTS origin text;
ALTER TABLE memories ADD COLUMN IF NOT EXISTS embedding_model text;
CREATE UNIQUE INDEX IF NOT EXISTS memories_origin_key ON memories (origin) WHERE origin IS NOT NULL;
CREATE INDEX IF NOT EXISTS memories_live_idx ON memories (created_at) WHERE superseded_by IS NULL;

CREATE TABLE IF NOT EXISTS failed_operations (
    id            bigserial PRIMARY KEY,
    op_type       varchar(50) NOT NULL,
    label         text NOT NULL,
    error_message text NOT NULL,
    context_data  jsonb,
    created_at    timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS source_queue text;
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS item_id bigint;
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS idempotency_key text;
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS attempts int;
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS retried_at timestamptz;
ALTER TABLE failed_operations ADD COLUMN IF NOT EXISTS retried_as bigint;
CREATE INDEX IF NOT EXISTS failed_operations_created_at_idx ON failed_operations (created_at DESC);
CREATE INDEX IF NOT EXISTS failed_operations_op_type_idx ON failed_operations (op_type);
-- One dead-letter row per item that left a queue, even if two settles raced.
CREATE UNIQUE INDEX IF NOT EXISTS failed_operations_item_key
    ON failed_operations (source_queue, item_id) WHERE item_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS processed_emails (
    message_id varchar(255) PRIMARY KEY,
    seen_at    timestamptz DEFAULT now()
);
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS item_id bigint;

CREATE TABLE IF NOT EXISTS adaptive_params (
    key        varchar(100) PRIMARY KEY,
    value      double precision NOT NULL,
    source     varchar(50) NOT NULL DEFAULT 'default',
    reason     text,
    updated_at timestamptz DEFAULT now()
);

-- The two work queues share one shape; the claim, settle and retry code is the same.
CREATE TABLE IF NOT EXISTS pending_triage (
    id               bigserial PRIMARY KEY,
    payload          jsonb NOT NULL,
    idempotency_key  text,
    source           text NOT NULL DEFAULT 'conversation',
    attempts         int NOT NULL DEFAULT 0,
    run_after        timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_expires_at timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS pending_distillation (
    id               bigserial PRIMARY KEY,
    payload          jsonb NOT NULL,
    idempotency_key  text,
    attempts         int NOT NULL DEFAULT 0,
    run_after        timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_expires_at timestamptz,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
-- Every attempt's error, kept for the failed_operations row.
ALTER TABLE pending_triage ADD COLUMN IF NOT EXISTS attempt_errors jsonb NOT NULL DEFAULT '[]';
ALTER TABLE pending_distillation ADD COLUMN IF NOT EXISTS attempt_errors jsonb NOT NULL DEFAULT '[]';
CREATE UNIQUE INDEX IF NOT EXISTS pending_triage_idempotency_key
    ON pending_triage (idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS pending_distillation_idempotency_key
    ON pending_distillation (idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS pending_triage_run_after_idx ON pending_triage (run_after, id);
CREATE INDEX IF NOT EXISTS pending_distillation_run_after_idx ON pending_distillation (run_after, id);

-- Idempotency keys outlive their items, so a key enqueued again after its item finished
-- still returns the original id (race-free: the key row is inserted before the item).
CREATE TABLE IF NOT EXISTS sokratos_idempotency_keys (
    queue      text NOT NULL,
    key        text NOT NULL,
    item_id    bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, key)
);

CREATE TABLE IF NOT EXISTS work_outcomes (
    id              bigserial PRIMARY KEY,
    queue           text NOT NULL,
    item_id         bigint NOT NULL,
    idempotency_key text,
    source          text NOT NULL,
    outcome         text NOT NULL CHECK (outcome IN ('saved', 'skipped', 'archived', 'failed')),
    memory_ids      bigint[] NOT NULL DEFAULT '{}',
    detail          text,
    attempts        int,
    backend         text,
    decided_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (queue, item_id)
);
CREATE INDEX IF NOT EXISTS work_outcomes_decided_at_idx ON work_outcomes (decided_at);

CREATE TABLE IF NOT EXISTS email_checkpoints (
    account       text NOT NULL,
    mailbox       text NOT NULL,
    uidvalidity   bigint,
    last_uid      bigint NOT NULL DEFAULT 0,
    checked_at    timestamptz,
    last_error    text,
    last_error_at timestamptz,
    PRIMARY KEY (account, mailbox)
);

CREATE TABLE IF NOT EXISTS worker_heartbeats (
    worker_id    text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          int NOT NULL,
    version      text NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_tick_at timestamptz,
    state        text NOT NULL DEFAULT 'starting',
    detail       jsonb NOT NULL DEFAULT '{}'
);
