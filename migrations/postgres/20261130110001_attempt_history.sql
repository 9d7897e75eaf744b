-- Attempt history (issue 11): when the latest attempt may have reached the provider, and whether
-- any attempt may have acted without its outcome being recorded.
ALTER TABLE idempotency_keys ADD COLUMN last_attempt_at timestamptz;
ALTER TABLE idempotency_keys ADD COLUMN may_have_acted boolean NOT NULL DEFAULT false;
-- Rows from before: the latest attempt started no later than the last write; a processing key
-- that was taken over before may have acted.
UPDATE idempotency_keys SET last_attempt_at = updated_at,
    may_have_acted = (state = 'processing' AND attempts > 1);
