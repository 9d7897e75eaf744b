//! The one shape of a builder setter, `fn name(mut self, value) -> Self`, written once for every
//! option stored as it is given: in the builder itself, in a settings struct it holds
//! (`in config;`), or in settings it shares with its clones behind an `Arc`, copied on write
//! (`shared config;`). A setter that does more than store its value (converts it, clamps it,
//! adds it to a list) is written by hand beside them, in the same shape.

/// Writes `pub fn $name(mut self, $field: $ty) -> Self { <place>.$field = $field; self }` for
/// each `$(#[doc])* $name($field: $ty);`, keeping each setter's doc comment. The place is `self`,
/// `self.$inner` after `in $inner;`, or `Arc::make_mut(&mut self.$inner)` after `shared $inner;`.
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
    (shared $inner:ident; $($(#[$attr:meta])* $name:ident($field:ident: $ty:ty);)*) => {
        $(
            $(#[$attr])*
            pub fn $name(mut self, $field: $ty) -> Self {
                std::sync::Arc::make_mut(&mut self.$inner).$field = $field;
                self
            }
        )*
    };
}
pub(crate) use setters;
