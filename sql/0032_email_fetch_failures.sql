-- A message the server refuses to return (UID FETCH answered NO, or BYE on a damaged mail
-- store) stops each check before it. The UID refused last and on how many consecutive
-- checks, kept across processes (`run --once` is one check per process), so that after a few
-- the message is recorded in failed_operations and passed instead of holding the account
-- back forever. Cleared by a complete check, a UIDVALIDITY reset, or another UID refused.
ALTER TABLE email_checkpoints ADD COLUMN IF NOT EXISTS refused_uid bigint;
ALTER TABLE email_checkpoints ADD COLUMN IF NOT EXISTS refused_checks integer NOT NULL DEFAULT 0;
