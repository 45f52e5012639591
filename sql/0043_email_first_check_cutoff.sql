-- When an account's first check began: its first attempt stores it when it opens the mailbox,
-- and every attempt until first_check_done measures the initial lookback from it (the cutoff
-- is this minus SOKRATOS_EMAIL_INITIAL_LOOKBACK as configured now, so a changed setting
-- applies to a resumed first check). Measured from each attempt's own time instead, a first
-- check killed or failed part-way and resumed later recorded mail inside the first attempt's
-- window (or delivered after it began) as seen without triage. Like first_check_done (0031),
-- it is kept through UIDVALIDITY resets.
ALTER TABLE email_checkpoints ADD COLUMN IF NOT EXISTS first_check_started_at timestamptz;
