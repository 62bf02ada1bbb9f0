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
});
