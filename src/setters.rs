//! The one shape of a builder setter (`fn name(mut self, value) -> Self`), written once for the
//! option types (`SqliteConfig`, `RedisConfig`, `PoolOptions`, `FaultyStore`). A setter that
//! does more than store its value (clamps it, converts it) is written by hand beside them.

/// Writes `pub fn $name(mut self, $field: $ty) -> Self { self.$field = $field; self }` for each
/// `$(#[doc])* $name($field: $ty);`, keeping each setter's doc comment; after `in $inner;`, the
/// setters write `self.$inner.$field` (a builder that keeps its settings in a struct).
macro_rules! setters {
    ($($(#[$attr:meta])* $name:ident($field:ident: $ty:ty);)*) => {
        $(
            $(#[$attr])*
            pub fn $name(mut self, $field: $ty) -> Self {
                self.$field = $field;
                self
            }
        )*
    };
    (in $inner:ident; $($(#[$attr:meta])* $name:ident($field:ident: $ty:ty);)*) => {
        $(
            $(#[$attr])*
            pub fn $name(mut self, $field: $ty) -> Self {
                self.$inner.$field = $field;
                self
            }
        )*
    };
}
pub(crate) use setters;
