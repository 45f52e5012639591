-- What the mailbox's listing says of each message the worker records, so the restore check
-- (email/check.py) can tell whether the message now at the checkpoint's UID is the one
-- recorded there from the `UID FETCH last_uid:* (UID RFC822.SIZE INTERNALDATE)` every check
-- makes anyway, without fetching the message: computing its key had meant its header block
-- on every check (unbounded), and its whole body (up to 16 MB) when it has no Message-ID.
--
-- * server_size, internal_date: the message's RFC822.SIZE and INTERNALDATE when it was
--   recorded (moved with the row's UID). NULL on rows recorded before this migration: the
--   check then compares keys over a bounded header fetch, and stores them once they match.
-- * status: NULL for a message recorded as usual (triaged, or seen without triage); 'passed'
--   for a row the worker writes for a message it passed without recording it (dead-lettered
--   in failed_operations: unparsable, refused by the database or by the server). Its key is
--   `<account>/passed/<sha256 of mailbox, UIDVALIDITY and UID>`, which no message's key can
--   be, whatever its Message-ID: those all start `<account>:`, and this one has no `:`. A
--   message's insert never updates a 'passed' row (store/email.py _insert_processed).
--   Like the rows of mail seen without triage, such rows have no item_id and are never
--   pruned: the failed_operations row, which retention deletes, was the only record that the
--   worker had passed that UID.
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS server_size bigint;
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS internal_date timestamptz;
ALTER TABLE processed_emails ADD COLUMN IF NOT EXISTS status text;
-- The restore check reads the rows at one UID of one account's mailbox on every check.
CREATE INDEX IF NOT EXISTS processed_emails_uid_idx ON processed_emails (account, mailbox, uid)
    WHERE account IS NOT NULL;
