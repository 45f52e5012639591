-- Email checks (issue 5): where each processed message sits in its mailbox, so that pruning
-- processed_emails never forgets a message the account's checkpoint has not yet passed.
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS mailbox text;
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS uidvalidity bigint;
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS uid bigint;
CREATE INDEX IF NOT EXISTS processed_emails_seen_at_idx ON processed_emails (seen_at);
CREATE INDEX IF NOT EXISTS processed_emails_account_idx ON processed_emails (account)
    WHERE account IS NOT NULL;
