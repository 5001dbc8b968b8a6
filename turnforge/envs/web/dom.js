// turnforge's compact view of a MiniWoB page: the visible elements an agent can read or act on,
// each with a ref (data-tf-ref, stable within an episode) that actions name.
(() => {
  const skip = new Set(["reward-display", "sync-task-cover", "click-canvas", "query"]);
  const out = [];
  let next = window.__tf_next || 1;
  const own = (el) => Array.from(el.childNodes).filter((n) => n.nodeType === 3).map((n) => n.data).join(" ").replace(/\s+/g, " ").trim();
  const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  const interactive = (el) => ["INPUT", "BUTTON", "A", "SELECT", "TEXTAREA"].includes(el.tagName) || el.onclick != null
        || el.classList.contains("alink")
        || el.getAttribute("role") === "button" || el.classList.contains("ui-menu-item-wrapper");
  const walk = (el) => {
    if (skip.has(el.id) || !visible(el)) return;
    const tag = el.tagName.toLowerCase();
    if (el.tagName === "LABEL") {  // a checkbox or radio button inside its label: the input, named by the label
      const box = el.querySelector("input[type=checkbox], input[type=radio]");
      if (box) {
        if (!box.dataset.tfRef) box.dataset.tfRef = String(next++);
        out.push({ref: +box.dataset.tfRef, tag: "input", type: box.type, checked: box.checked, id: box.id || "",
                  text: el.textContent.replace(/\s+/g, " ").trim(), focused: document.activeElement === box});
        return;
      }
    }
    let text = "";
    if (["BUTTON", "A", "LABEL", "OPTION"].includes(el.tagName)) text = el.textContent.replace(/\s+/g, " ").trim();
    else text = own(el);
    const act = interactive(el);
    if (act || text) {
      if (!el.dataset.tfRef) el.dataset.tfRef = String(next++);
      const kind = el.classList.contains("alink") ? "link" : (el.classList.contains("ui-menu-item-wrapper") ? "option" : tag);
      const item = {ref: +el.dataset.tfRef, tag: kind, text: text, id: el.id || ""};
      if (el.tagName === "INPUT") {
        item.type = el.type;
        if (el.type === "checkbox" || el.type === "radio") {
          item.checked = el.checked;
          const label = el.closest("label");
          if (label) item.text = label.textContent.replace(/\s+/g, " ").trim();
        } else item.value = el.value;
      }
      if (el.tagName === "TEXTAREA") item.value = el.value;
      if (el.tagName === "SELECT") { item.options = Array.from(el.options).map((o) => o.text); item.value = el.options[el.selectedIndex] ? el.options[el.selectedIndex].text : ""; }
      if (el.title) item.title = el.title;
      if (document.activeElement === el) item.focused = true;
      out.push(item);
      if (["BUTTON", "A", "LABEL", "SELECT"].includes(el.tagName)) { window.__tf_next = next; return; }
    }
    for (const child of el.children) walk(child);
  };
  walk(document.body);
  window.__tf_next = next;
  return out;
})()
