-- The initial-lookback cutoff of an account's first check, fixed when its first attempt opens
-- the mailbox and reused by every later attempt until first_check_done. Computed again from
-- each attempt's own time, a first check killed or failed part-way and resumed later recorded
-- mail inside the first attempt's window (or delivered after it began) as seen without
-- triage. Like first_check_done (0031), it is kept through UIDVALIDITY resets.
ALTER TABLE email_checkpoints ADD COLUMN IF NOT EXISTS first_check_cutoff timestamptz;
