//! The claim, the finish and the lease renewal as stored procedures, one file each in
//! `procedures/`. `MySqlStore::migrate` creates them from these texts after the migrations.
//!
//! Why procedures: MariaDB has no `UPDATE .. RETURNING` and MySQL no `RETURNING` at all, so a
//! claim or a finish as plain statements is three or four round trips where a `CALL` is one
//! (`docs/design.md`, "MariaDB: the transitions are procedures").
//!
//! A procedure's name carries a version (`idempotency_keys_claim_v1`): a changed text is a new
//! name, created beside the old one, so the processes of the previous release keep calling the
//! procedure they were built with during a rolling deploy. The old versions stay until dropped
//! by hand (`DROP PROCEDURE idempotency_keys_claim_v1`).

/// The procedures' texts, each one `CREATE PROCEDURE IF NOT EXISTS`.
pub(super) const PROCEDURES: [&str; 3] = [
    include_str!("procedures/claim.sql"),
    include_str!("procedures/finish.sql"),
    include_str!("procedures/extend.sql"),
];

/// The claim procedure's text, for the test that checks its reason spellings.
#[cfg(test)]
pub(in crate::store) const CLAIM: &str = PROCEDURES[0];

#[cfg(test)]
mod tests {
    use super::*;

    /// The name a procedure file creates, and the name a `CALL` file calls.
    fn name_after<'a>(text: &'a str, prefix: &str) -> &'a str {
        let start = text.find(prefix).expect("the prefix is in the text") + prefix.len();
        let len = text[start..]
            .find('(')
            .expect("a parameter list follows the name");
        &text[start..start + len]
    }

    fn fnv1a(text: &str) -> u64 {
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    const CREATE: &str = "CREATE PROCEDURE IF NOT EXISTS ";

    #[test]
    fn each_call_names_the_procedure_its_file_creates_with_as_many_parameters() {
        let calls = [
            super::super::sql::CLAIM,
            super::super::sql::FINISH,
            super::super::sql::EXTEND,
        ];
        for (call, text) in calls.into_iter().zip(PROCEDURES) {
            assert_eq!(name_after(call, "CALL "), name_after(text, CREATE));
            let declared = text.matches("\n    IN p_").count();
            assert_eq!(call.matches('?').count(), declared, "{call}");
        }
    }

    /// Holds the digest of each procedure's text under its versioned name. A failure here means
    /// a procedure's text changed under the same name: a database that has the old text would
    /// keep it (`IF NOT EXISTS`). Bump the version in the file and in its `CALL`, then put the
    /// new name and digest here.
    #[test]
    fn a_changed_procedure_has_a_new_name() {
        let known: [(&str, u64); 3] = [
            ("idempotency_keys_claim_v1", 0xbb06d57cfeb35aca),
            ("idempotency_keys_finish_v1", 0xfb6ad8510b3a230b),
            ("idempotency_keys_extend_v1", 0x2addd1a6e94e4281),
        ];
        for (text, (name, digest)) in PROCEDURES.into_iter().zip(known) {
            assert_eq!(
                (name_after(text, CREATE), fnv1a(text)),
                (name, digest),
                "a procedure's text changed: give it a new version"
            );
        }
    }
}
