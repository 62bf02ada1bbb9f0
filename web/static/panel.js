// Confirmation for destructive forms, copy-to-clipboard for a new key. No dependencies.
document.addEventListener("submit", function (ev) {
  var btn = ev.submitter || ev.target.querySelector("[data-confirm]");
  var msg = btn && btn.getAttribute("data-confirm");
  if (msg && !window.confirm(msg)) { ev.preventDefault(); return; }
  if (btn) { btn.disabled = true; btn.classList.add("busy"); }
});
document.addEventListener("DOMContentLoaded", function () {
  var key = document.getElementById("new-key-value");
  if (key) { key.addEventListener("focus", function () { key.select(); }); }
  var copy = document.getElementById("copy-key");
  if (copy && key) {
    copy.addEventListener("click", function () {
      var done = function () { copy.textContent = "Copied"; };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(key.value).then(done, function () { key.select(); });
      } else { key.select(); if (document.execCommand("copy")) { done(); } }
    });
  }
});
