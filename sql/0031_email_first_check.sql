-- Whether an account's first check ever completed, kept through UIDVALIDITY resets.
-- checked_at is cleared by a reset (pruning waits for the new epoch's complete re-read), so
-- "checked_at IS NULL" could not tell a new account from a re-read that failed part-way; the
-- next check then applied the initial lookback and recorded older unseen mail as seen
-- without triage.
ALTER TABLE email_checkpoints ADD COLUMN IF NOT EXISTS first_check_done boolean NOT NULL DEFAULT false;
UPDATE email_checkpoints SET first_check_done = true WHERE checked_at IS NOT NULL;
